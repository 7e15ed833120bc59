"""Per-layer KV cache specs.

A model is described as an ordered tuple of layer specs, one per layer. Each
spec is a frozen dataclass; the layer ``name`` does not take part in equality,
so two layers with the same shape and attention type compare equal and can be
put in one KV cache group by the planner.

Each spec type states its own rules as class attributes and methods, so that
the planner, the cache, the attention and the models ask the spec instead of
testing its type: ``owns_kv`` (it has a KV cache of its own), ``paged_kv`` (its
K/V sit in pages, one row per token: the attention types), ``recurrent`` (one
state per request: Mamba), ``keeps_every_token`` (full attention), ``window``
and ``chunk`` (the attention mask's bounds), ``blocks_held`` (blocks a request
holds) and ``as_full`` (the same layer as full attention, for comparisons). The
allocator's rules per type (hits, releases) are its managers'
(``allocator/managers.py``); ``allocator/pymodel.py`` states every rule again,
independently, as the oracle.

Byte sizes follow the design doc's vocabulary: an attention layer stores
``2 * num_kv_heads * head_size * itemsize`` bytes per token (K and V), so a
block of ``block_size`` tokens takes ``page_size_bytes(block_size)`` bytes of
one layer. A Mamba layer stores one recurrent state per request, whatever the
block size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(dtype: str, where: str = "") -> int:
    """Bytes per element of ``dtype`` (a name such as ``"bfloat16"``)."""
    try:
        return DTYPE_BYTES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}"
        ) from None


def _positive_int(value: Any, field_name: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}{field_name} must be a positive int, got {value!r}")


def _where(name: str) -> str:
    return f"layer {name!r}: " if name else ""


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Common fields of the attention specs (K/V shape of one layer)."""

    kind: ClassVar[str] = "attention"
    owns_kv: ClassVar[bool] = True
    paged_kv: ClassVar[bool] = True
    recurrent: ClassVar[bool] = False
    keeps_every_token: ClassVar[bool] = False
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = _where(self.name)
        _positive_int(self.num_kv_heads, "num_kv_heads", where)
        _positive_int(self.head_size, "head_size", where)
        dtype_bytes(self.dtype, where)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token of this layer (the design doc's kv hidden size)."""
        return 2 * self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` tokens takes in this layer."""
        return block_size * self.bytes_per_token

    @property
    def window(self) -> int | None:
        """The sliding window (a token sees itself and ``window - 1`` earlier tokens), if any."""
        return None

    @property
    def chunk(self) -> int | None:
        """The attention chunk (tokens see their aligned chunk only), if any."""
        return None

    def blocks_held(self, num_tokens: int, block_size: int, blocks_per_state: int = 1, chunk: int = 1) -> int:
        """Blocks a request of ``num_tokens`` tokens holds in a group of this layer (upper bound) during a
        step that computes the last ``chunk`` of them (1: a decode step; a prefill chunk holds more blocks
        of a window or local chunk at once)."""
        del blocks_per_state, chunk
        return -(-num_tokens // block_size)

    def as_full(self) -> "FullAttentionSpec":
        """This layer as full attention (what an all-full-attention cache would hold)."""
        return FullAttentionSpec(name=self.name, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                 dtype=self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """The layer as a trace-format layer object (``docs/trace-format.md``)."""
        d: dict[str, Any] = {"name": self.name, "type": self.kind}
        for f in dataclasses.fields(self):
            if f.name != "name":
                d[f.name] = getattr(self, f.name)
        return d


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) causal attention: keeps KV for every token."""

    kind: ClassVar[str] = "full"
    keeps_every_token: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token sees itself and ``sliding_window - 1`` earlier tokens."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(self.sliding_window, "sliding_window", _where(self.name))

    @property
    def window(self) -> int:
        return self.sliding_window

    def blocks_held(self, num_tokens: int, block_size: int, blocks_per_state: int = 1, chunk: int = 1) -> int:
        """The blocks of the step's first token's window through its last token (``window + chunk - 1``
        tokens), one more where they straddle a boundary."""
        del blocks_per_state
        return min(-(-num_tokens // block_size), -(-(self.sliding_window + chunk - 2) // block_size) + 1)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalSpec(AttentionSpec):
    """Chunked local attention (Llama 4): tokens attend within their aligned chunk."""

    kind: ClassVar[str] = "chunked_local"
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int(self.attention_chunk_size, "attention_chunk_size", _where(self.name))

    @property
    def chunk(self) -> int:
        return self.attention_chunk_size

    def blocks_held(self, num_tokens: int, block_size: int, blocks_per_state: int = 1, chunk: int = 1) -> int:
        """The blocks of the step's first token's attention chunk through its last token, one more where they
        start inside a block."""
        del blocks_per_state
        return min(-(-num_tokens // block_size), -(-(self.attention_chunk_size + chunk - 1) // block_size) + 1)


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """A recurrent (Mamba / linear-attention) layer: one state per request.

    ``shapes[i]`` and ``dtypes[i]`` describe the i-th state tensor of the layer
    (conv state, SSM state, ...).
    """

    kind: ClassVar[str] = "mamba"
    owns_kv: ClassVar[bool] = True
    paged_kv: ClassVar[bool] = False
    recurrent: ClassVar[bool] = True
    keeps_every_token: ClassVar[bool] = False
    window: ClassVar[None] = None
    chunk: ClassVar[None] = None
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = _where(self.name)
        # Normalise lists (from JSON) to tuples so that specs stay hashable.
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not self.shapes:
            raise ValueError(f"{where}a Mamba layer needs at least one state shape")
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"{where}{len(self.shapes)} state shapes but {len(self.dtypes)} dtypes"
            )
        for shape in self.shapes:
            for dim in shape:
                _positive_int(dim, "every state dimension", where)
        for dt in self.dtypes:
            dtype_bytes(dt, where)

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state of this layer."""
        return sum(
            math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes)
        )

    def page_size_bytes(self, block_size: int) -> int:
        """A state does not grow with tokens: the page is one state."""
        del block_size
        return self.state_bytes

    def blocks_held(self, num_tokens: int, block_size: int, blocks_per_state: int = 1, chunk: int = 1) -> int:
        """One state, whatever the tokens: ``blocks_per_state`` pages."""
        del num_tokens, block_size, chunk
        return blocks_per_state

    def as_full(self) -> "MambaSpec":
        """A state is a state under any attention: itself."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The layer as a trace-format layer object."""
        return {
            "name": self.name,
            "type": self.kind,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
        }


@dataclass(frozen=True, kw_only=True)
class KVSharingSpec:
    """A layer that reads another (earlier) layer's KV cache and owns none."""

    kind: ClassVar[str] = "kv_sharing"
    owns_kv: ClassVar[bool] = False
    paged_kv: ClassVar[bool] = False
    recurrent: ClassVar[bool] = False
    keeps_every_token: ClassVar[bool] = False
    target: str
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"{_where(self.name)}kv sharing target must be a layer name")
        if self.target == self.name:
            raise ValueError(f"{_where(self.name)}a layer cannot share its own KV cache")

    def to_dict(self) -> dict[str, Any]:
        """The layer as a trace-format layer object (type left to the target)."""
        return {"name": self.name, "kv_sharing_target": self.target}


KVSpec = Union[FullAttentionSpec, SlidingWindowSpec, ChunkedLocalSpec, MambaSpec]
LayerSpec = Union[KVSpec, KVSharingSpec]

_ATTENTION_TYPES: dict[str, type[AttentionSpec]] = {
    "full": FullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "chunked_local": ChunkedLocalSpec,
}


def layer_from_dict(d: dict[str, Any]) -> LayerSpec:
    """Build a spec from a trace-format layer object (``docs/trace-format.md`` 1.1).

    Raises ``ValueError`` naming the layer for unknown types or bad fields.
    """
    name = d.get("name", "")
    where = _where(name)
    if d.get("kv_sharing_target"):
        return KVSharingSpec(name=name, target=d["kv_sharing_target"])
    kind = d.get("type")
    try:
        if kind == "mamba":
            return MambaSpec(name=name, shapes=d["shapes"], dtypes=d["dtypes"])
        cls = _ATTENTION_TYPES.get(kind)
        if cls is None:
            raise ValueError(
                f"{where}unknown layer type {kind!r}; expected one of "
                f"{', '.join([*_ATTENTION_TYPES, 'mamba'])}"
            )
        kwargs = {
            "name": name,
            "num_kv_heads": d["num_kv_heads"],
            "head_size": d["head_size"],
            "dtype": d.get("dtype", "bfloat16"),
        }
        if cls is SlidingWindowSpec:
            kwargs["sliding_window"] = d["sliding_window"]
        elif cls is ChunkedLocalSpec:
            kwargs["attention_chunk_size"] = d["attention_chunk_size"]
        return cls(**kwargs)
    except KeyError as e:
        raise ValueError(f"{where}missing field {e.args[0]!r} for a {kind} layer") from None
    except TypeError as e:
        raise ValueError(f"{where}{e}") from None


def layers_from_trace(trace: dict[str, Any]) -> tuple[LayerSpec, ...]:
    """The layers of a trace: its explicit ``layers`` or its expanded ``layer_pattern``."""
    if "layers" in trace:
        raw = list(trace["layers"])
    elif "layer_pattern" in trace:
        lp = trace["layer_pattern"]
        fmt = lp.get("name_format", "model.layers.{i}.attn")
        pattern = lp["pattern"]
        raw = [dict(pattern[i % len(pattern)], name=fmt.format(i=i)) for i in range(lp["num_layers"])]
    else:
        raise ValueError("trace has neither 'layers' nor 'layer_pattern'")
    return tuple(layer_from_dict(d) for d in raw)


def with_name(spec: LayerSpec, name: str) -> LayerSpec:
    """A copy of ``spec`` for layer ``name``."""
    return dataclasses.replace(spec, name=name)
