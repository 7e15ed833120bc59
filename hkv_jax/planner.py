"""The KV cache planner: layer specs + a memory budget -> ``KVCacheConfig``.

Static Python that runs once. It splits a model's layers into KV cache groups
that share one page size, picks the block size of every group, the number of
blocks of the pool, and the shared tensors (tensor ``i`` holds slot ``i`` of
every block; the i-th layer of each group lives in it).

Policies (``docs/SEMANTICS.md``, "Planning", states ``vllm`` exactly):

``vllm``
    vLLM 0.33's grouping: group size is the smallest bucket's layer count
    (the largest one when largest < 1.5 x smallest), strided assignment,
    attention block size raised until one page holds a Mamba state.
``min-waste`` (default)
    Chooses the group size minimising ``padding layers + GROUP_COST x groups``.
    A group costs little here because the allocator handles groups vectorised;
    ``GROUP_COST`` (0.02 layer) only breaks ties towards fewer groups and keeps
    the count bounded. Mamba never raises the attention block size: a state
    spans ``blocks_per_state`` pages instead. A layer whose page is ``r`` times
    smaller than the largest keeps the block size and shares a page slot with
    ``r - 1`` others of its kind (``layers_per_slot``) instead of taking ``r``
    times the tokens per block, unless that pads more: every group then has
    one block size, and prefix hits land on every block (Gemma 4: 16 tokens
    where ``vllm`` needs 32).
``naive``
    Every attention layer treated as full attention (what a cache that is not
    hybrid-aware needs); Mamba as under ``vllm``. For comparison only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hkv_jax.spec import (
    KVSpec,
    LayerSpec,
)

POLICIES = ("vllm", "min-waste", "naive")
DEFAULT_POLICY = "min-waste"
GROUP_COST = 0.02
MAX_GROUPS = 64


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block ids: one spec, one block size.

    ``layer_names[i]`` owns slot ``i`` of every block (it lives in shared
    tensor ``i``); ``shared_layer_names`` read the KV of a layer of this group.
    """

    group_id: int
    spec: KVSpec
    layer_names: tuple[str, ...]
    block_size: int
    shared_layer_names: tuple[str, ...] = ()
    blocks_per_state: int = 1
    layers_per_slot: int = 1  # layers sharing one page slot (their pages are this many times smaller)

    @property
    def all_layer_names(self) -> tuple[str, ...]:
        """Owning and KV-sharing layers of the group."""
        return self.layer_names + self.shared_layer_names

    @property
    def num_slots(self) -> int:
        """Page slots (shared tensors) the group's layers take: ``layers_per_slot`` layers each."""
        return cdiv(len(self.layer_names), self.layers_per_slot)

    def slot_of(self, i: int) -> tuple[int, int]:
        """(shared tensor, part of the page) of the group's ``i``-th layer."""
        return divmod(i, self.layers_per_slot)

    def used_bytes_per_slot(self) -> float:
        """Bytes of a page slot that hold data (the rest is padding)."""
        if self.spec.recurrent:
            return self.spec.state_bytes / self.blocks_per_state
        return self.spec.page_size_bytes(self.block_size)

    def blocks_per_request(self, num_tokens: int, chunk: int = 1) -> int:
        """Blocks a request of ``num_tokens`` tokens holds in this group (upper bound) during a step that
        computes the last ``chunk`` of them (1: a decode step; ``spec.blocks_held``)."""
        return self.spec.blocks_held(num_tokens, self.block_size, self.blocks_per_state, chunk)


def merge_parts(parts: tuple[tuple[int, ...], ...], rows: list[list[int]]) -> list[list[int]]:
    """Per-KV-cache-group block lists from per-allocator-group ones (``allocator_groups``' parts).

    A spanning Mamba group lists each table entry's pages in part order:
    entry ``i``'s page ``j`` is element ``i * k + j``.
    """
    return [[b for entry in zip(*(rows[j] for j in p)) for b in entry] for p in parts]


@dataclass(frozen=True)
class KVCacheTensor:
    """One page-major buffer: ``size_bytes`` shared by one layer of each group."""

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The plan of the KV memory pool (what the allocator and cache memory are built from).

    ``num_blocks`` counts the null block 0. One block is ``group_size`` slots of
    ``page_size_bytes`` each, one slot per shared tensor.
    """

    policy: str
    num_blocks: int
    page_size_bytes: int
    group_size: int
    groups: tuple[KVCacheGroup, ...]
    kv_sharing: tuple[tuple[str, str], ...] = ()
    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all shared tensors."""
        return self.group_size * self.page_size_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool, null block included."""
        return self.num_blocks * self.bytes_per_block

    @property
    def block_size(self) -> int:
        """The smallest block size of the groups (tokens)."""
        return min(g.block_size for g in self.groups)

    @property
    def hash_block_size(self) -> int:
        """Tokens per prefix hash: the gcd of the groups' block sizes (vLLM's ``hash_block_size``)."""
        return math.gcd(*(g.block_size for g in self.groups))

    @property
    def scheduler_block_size(self) -> int:
        """The lcm of the groups' block sizes: prefix-cache hits are multiples of it (vLLM's
        ``scheduler_block_size``)."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def tensors(self) -> tuple[KVCacheTensor, ...]:
        """The shared tensors: tensor ``i`` holds the i-th layer of every group."""
        return tuple(
            KVCacheTensor(
                size_bytes=self.num_blocks * self.page_size_bytes,
                shared_by=tuple(n for g in self.groups
                                for n in g.layer_names[i * g.layers_per_slot:(i + 1) * g.layers_per_slot]),
            )
            for i in range(self.group_size)
        )

    def group_padding_layers(self, group: KVCacheGroup) -> int:
        """Empty page slots of a group (vLLM's "padding layers"; a slot shared by fewer layers than it
        holds counts in ``group_padding_fraction`` only)."""
        return self.group_size - group.num_slots

    @property
    def padding_layers(self) -> int:
        """Empty layer slots over all groups."""
        return sum(self.group_padding_layers(g) for g in self.groups)

    def group_padding_fraction(self, group: KVCacheGroup) -> float:
        """Fraction of a block held by ``group`` that stores no data."""
        used = len(group.layer_names) * group.used_bytes_per_slot()
        return 1.0 - used / self.bytes_per_block

    @property
    def padding_fraction(self) -> float:
        """Mean over groups of the wasted fraction of a block (slots and in-page padding)."""
        return sum(self.group_padding_fraction(g) for g in self.groups) / len(self.groups)

    @property
    def capacity_tokens(self) -> int:
        """vLLM's headline KV capacity: usable blocks split evenly over groups, in tokens."""
        return (self.num_blocks - 1) // len(self.groups) * self.block_size

    def blocks_per_request(self, num_tokens: int, chunk: int = 1) -> int:
        """Blocks one request of ``num_tokens`` tokens holds across all groups during a step that computes
        the last ``chunk`` of them (1: a decode step)."""
        return sum(g.blocks_per_request(num_tokens, chunk) for g in self.groups)

    def max_concurrent_requests(self, num_tokens: int) -> int:
        """How many requests of ``num_tokens`` tokens fit in the pool at once."""
        return (self.num_blocks - 1) // self.blocks_per_request(num_tokens)

    def allocator_groups(self) -> tuple[tuple[KVCacheGroup, ...], tuple[tuple[int, ...], ...]]:
        """The groups the allocator tracks, and which of them make up each KV cache group.

        A Mamba group whose state spans ``k`` pages becomes ``k`` allocator
        groups of one page each (its parts): equal specs, so they are looked
        up, allocated (all or nothing) and released together, and a cached
        state hits only when all its pages are cached. Other groups map to
        themselves. Returns ``(groups, parts)``: ``groups[j].group_id == j``
        and ``parts[g]`` lists the allocator groups of KV cache group ``g``.
        """
        groups: list[KVCacheGroup] = []
        parts: list[tuple[int, ...]] = []
        for g in self.groups:
            first = len(groups)
            groups += [replace(g, group_id=first + j, blocks_per_state=1) for j in range(g.blocks_per_state)]
            parts.append(tuple(range(first, len(groups))))
        return tuple(groups), tuple(parts)

    def group_of_layer(self, name: str) -> KVCacheGroup:
        """The group holding layer ``name`` (owning or KV-sharing)."""
        for g in self.groups:
            if name in g.all_layer_names:
                return g
        raise KeyError(f"no layer {name!r} in the KV cache config")

    def to_dict(self, max_model_len: int | None = None) -> dict[str, Any]:
        """A JSON-ready description (the ``hkv plan --json`` output)."""
        d: dict[str, Any] = {
            "policy": self.policy,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "hash_block_size": self.hash_block_size,
            "scheduler_block_size": self.scheduler_block_size,
            "page_size_bytes": self.page_size_bytes,
            "bytes_per_block": self.bytes_per_block,
            "total_bytes": self.total_bytes,
            "num_groups": len(self.groups),
            "group_size": self.group_size,
            "padding_layers": self.padding_layers,
            "padding_fraction": round(self.padding_fraction, 6),
            "capacity_tokens": self.capacity_tokens,
            "groups": [
                {
                    "group_id": g.group_id,
                    "type": g.spec.kind,
                    "spec": {k: v for k, v in g.spec.to_dict().items() if k != "name"},
                    "block_size": g.block_size,
                    "blocks_per_state": g.blocks_per_state,
                    "layers_per_slot": g.layers_per_slot,
                    "num_layers": len(g.layer_names),
                    "layer_names": list(g.all_layer_names),
                    "padding_layers": self.group_padding_layers(g),
                    "padding_fraction": round(self.group_padding_fraction(g), 6),
                }
                for g in self.groups
            ],
            "tensors": [
                {"size_bytes": t.size_bytes, "shared_by": list(t.shared_by)} for t in self.tensors
            ],
            "kv_sharing": dict(self.kv_sharing),
            "notes": dict(self.notes),
        }
        if max_model_len is not None:
            d["max_model_len"] = max_model_len
            d["blocks_per_request"] = self.blocks_per_request(max_model_len)
            d["max_concurrent_requests"] = self.max_concurrent_requests(max_model_len)
        return d


def _validate_layers(layers: Sequence[LayerSpec]) -> None:
    if not layers:
        raise ValueError("a model needs at least one layer")
    names = [l.name for l in layers]
    if any(not n for n in names):
        raise ValueError("every layer needs a name")
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate layer names: {sorted(dup)}")
    owners = {l.name for l in layers if l.owns_kv}
    for l in layers:
        if not l.owns_kv and l.target not in owners:
            raise ValueError(
                f"layer {l.name!r}: kv sharing target {l.target!r} is not a layer with its own KV cache"
            )
    if not owners:
        raise ValueError("no layer owns a KV cache")


def _buckets(specs: Sequence[KVSpec]) -> list[list[KVSpec]]:
    """Layers bucketed by identical spec, buckets in order of first appearance."""
    buckets: dict[KVSpec, list[KVSpec]] = {}
    for s in specs:
        buckets.setdefault(s, []).append(s)
    return list(buckets.values())


def _padding(counts: Sequence[float], group_size: int) -> tuple[float, int]:
    """(padding page slots, number of groups) for a group size; ``counts`` in page slots (a bucket whose
    layers share slots counts a fraction per layer)."""
    groups = sum(math.ceil(n / group_size - 1e-9) for n in counts)
    return groups * group_size - sum(counts), groups


def choose_group_size(counts: Sequence[float], policy: str) -> int:
    """Page slots per group for buckets of ``counts`` page slots of layers under ``policy``."""
    if len(counts) == 1:
        return math.ceil(counts[0])
    lo, hi = min(counts), max(counts)
    if policy != "min-waste":
        return math.ceil(hi if hi < 1.5 * lo else lo)
    best = None
    for g in range(math.ceil(hi), 0, -1):  # larger group sizes win ties
        pad, groups = _padding(counts, g)
        if groups > MAX_GROUPS:
            continue
        cost = pad + GROUP_COST * groups
        if best is None or cost < best[0] - 1e-12:
            best = (cost, g)
    assert best is not None  # g = hi always gives len(counts) <= MAX_GROUPS groups
    return best[1]


def _group(buckets: list[list[KVSpec]], policy: str, sizes, page: int) -> list[KVCacheGroup]:
    """KV cache groups of ``buckets`` (identical specs): the group size (in page slots) for ``policy``, layers
    assigned strided. ``sizes(spec)``: (block size, layers per page slot)."""
    all_same = len(buckets) == 1
    per_slot = [sizes(b[0])[1] for b in buckets]
    gsize = choose_group_size([len(b) if r == 1 else len(b) / r for b, r in zip(buckets, per_slot)], policy)
    groups: list[KVCacheGroup] = []
    for bucket, r in zip(buckets, per_slot):
        k = 1 if all_same else cdiv(len(bucket), gsize * r)
        for j in range(k):
            members = bucket[j::k]
            spec = members[0]
            groups.append(KVCacheGroup(
                group_id=len(groups),
                spec=spec,
                layer_names=tuple(m.name for m in members),
                block_size=sizes(spec)[0],
                blocks_per_state=cdiv(spec.state_bytes, page) if spec.recurrent else 1,
                layers_per_slot=r,
            ))
    return groups


def _slots_padding(groups: list[KVCacheGroup]) -> float:
    """Empty page slots of ``groups``, a slot shared by fewer layers than it holds counting the fraction."""
    size = max(g.num_slots for g in groups)
    return sum(size - len(g.layer_names) / g.layers_per_slot for g in groups)


def plan(
    layers: Sequence[LayerSpec],
    *,
    block_size: int = 16,
    policy: str = DEFAULT_POLICY,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
) -> KVCacheConfig:
    """Plan the KV cache of ``layers`` (model order) under ``policy``.

    Give exactly one of ``memory_bytes`` (the pool's byte budget) or
    ``num_blocks`` (null block included). Raises ``ValueError`` for bad input.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block size must be a positive int, got {block_size!r}")
    if (memory_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of memory_bytes and num_blocks")
    _validate_layers(layers)
    owning: list[KVSpec] = [l for l in layers if l.owns_kv]
    if policy == "naive":
        owning = [s.as_full() for s in owning]
    attn = [s for s in owning if s.paged_kv]
    mamba = [s for s in owning if s.recurrent]
    notes: dict[str, Any] = {}

    # 1. The attention block size and the unified page size.
    attn_block = block_size
    if attn and mamba and policy != "min-waste":
        # vLLM: raise the block size until an attention page holds a Mamba state.
        per_tok = max(s.bytes_per_token for s in attn)
        max_state = max(s.state_bytes for s in mamba)
        attn_block = block_size * max(1, cdiv(max_state, block_size * per_tok))
        if attn_block != block_size:
            notes["attention_block_size_raised_from"] = block_size
    if attn:
        page = max(s.page_size_bytes(attn_block) for s in attn)
    else:
        page = max(s.state_bytes for s in mamba)

    def sizes_of(spec: KVSpec, pack: bool) -> tuple[int, int]:
        """(block size, layers per page slot) of a layer of ``spec``."""
        if spec.recurrent:
            return attn_block, 1
        own = spec.page_size_bytes(attn_block)
        if page % own:  # a page that does not divide the unified page is padded
            return attn_block, 1
        # One that divides it holds proportionally more tokens (vLLM), or shares its slot (packed).
        return (attn_block, page // own) if pack else (attn_block * (page // own), 1)

    # 2. Groups: bucket identical specs, pick the group size, assign strided.
    buckets = _buckets(owning)
    groups = _group(buckets, policy, lambda spec: sizes_of(spec, pack=False), page)
    if policy == "min-waste" and any(sizes_of(b[0], pack=True)[1] > 1 for b in buckets):
        packed = _group(buckets, policy, lambda spec: sizes_of(spec, pack=True), page)
        if _slots_padding(packed) <= _slots_padding(groups):
            groups = packed
            notes["layers_share_page_slots"] = True
    group_size = max(g.num_slots for g in groups)

    # 3. KV-sharing layers join their target's group.
    sharing = tuple((l.name, l.target) for l in layers if not l.owns_kv)
    for name, target in sharing:
        gi = next(i for i, g in enumerate(groups) if target in g.layer_names)
        groups[gi] = replace(groups[gi], shared_layer_names=groups[gi].shared_layer_names + (name,))

    # 4. Pool size.
    bytes_per_block = group_size * page
    if num_blocks is None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
            raise ValueError(f"memory must be a positive number of bytes, got {memory_bytes!r}")
        num_blocks = memory_bytes // bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"{memory_bytes} bytes hold {num_blocks} block(s) of {bytes_per_block} bytes; "
                "at least 2 are needed (the null block and one usable block)"
            )
    elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
        raise ValueError(f"num_blocks must be an int >= 2 (null block included), got {num_blocks!r}")
    return KVCacheConfig(
        policy=policy,
        num_blocks=num_blocks,
        page_size_bytes=page,
        group_size=group_size,
        groups=tuple(groups),
        kv_sharing=sharing,
        notes=notes,
    )
