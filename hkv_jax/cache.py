"""The KV cache memory: one page-major buffer per shared tensor, typed views per layer.

A ``KVCacheConfig`` has ``group_size`` shared tensors; tensor ``i`` holds the
i-th layer of every KV cache group, and block id ``b`` addresses page ``b`` of
every tensor. So each buffer is ``word[num_blocks, page_words]``, and a layer
sees it through a typed view made inside jit. The word is the attention layers'
KV dtype when they all share one (the common case): a view of a layer that
fills the page is then a reshape, free. Otherwise the word is an unsigned
integer and a view is a bitcast + reshape, which XLA:CPU runs as a copy:

- attention layer: ``dtype[num_blocks, 2, num_kv_heads, block_size, head_size]``
  (K then V; inside a page each kv head's tokens are contiguous, which is what
  the kernels stream);
- attention layers that share a page slot (``KVCacheGroup.layers_per_slot = r``:
  their pages are ``r`` times smaller): ``dtype[num_blocks * r, 2, ...]``, the
  page of block ``b`` for the layer in part ``j`` of the slot being page
  ``b * r + j`` of that view (a reshape too); ``part_pages`` maps the group's
  block table and slot mapping to those pages;
- sharded by KV head (``CacheLayout.shards[t] = S > 1``, for a ``model`` mesh
  axis of size S): a page is S equal parts, part ``j`` holding KV heads
  ``[j H/S, (j+1) H/S)`` in the layout above (then padding). A device holds one
  part of every page, ``word[num_blocks, page_words / S]``, which is the
  unsharded layout of its own heads, so kernels run on it unchanged under
  ``shard_map``. With S = 1 it is the layout above;
- Mamba layer: the state of one request is the bytes of its state tensors laid
  one after the other over its ``blocks_per_state`` pages, read and written
  with ``read_mamba_state`` / ``write_mamba_state``.

Layers that share another layer's KV (``KVSharingSpec``) resolve to their
target. ``slot_mapping`` turns token positions into physical slots through a
group's block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import jax
import jax.numpy as jnp

from hkv_jax.planner import KVCacheConfig
from hkv_jax.spec import AttentionSpec, MambaSpec, dtype_bytes
from kernels_pallas.reference import is_fp8

# Storage word per page: the widest of these that divides the page size.
_WORDS = ((4, jnp.uint32), (2, jnp.uint16), (1, jnp.uint8))


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer's KV lives: its shared tensor, group and spec (static)."""

    tensor: int
    group_id: int
    spec: AttentionSpec | MambaSpec
    block_size: int
    blocks_per_state: int = 1
    layers_per_slot: int = 1  # layers sharing the page slot; this one holds part ``part`` of each page
    part: int = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of each page this layer uses (attention) or of its whole state (Mamba)."""
        return self.spec.page_size_bytes(self.block_size)  # a Mamba spec's page is its state


@dataclass(frozen=True)
class CacheLayout:
    """Static description of the KV memory of a ``KVCacheConfig`` (hashable, jit-static)."""

    num_blocks: int
    page_size_bytes: int
    num_tensors: int
    slots: tuple[tuple[str, LayerSlot], ...]
    shards: tuple[int, ...] = ()  # per shared tensor: parts of a page, one per model-axis device (1: replicated)
    fp8_bytes: bool = False  # fp8 pages held in uint8 words (``word_dtype`` says why)

    @classmethod
    def from_config(cls, config: KVCacheConfig, model_shards: int = 1, fp8_bytes: bool = False) -> "CacheLayout":
        """The layout the planner's ``config`` describes (KV-sharing layers point at their target's slot).

        ``model_shards``: the size of the mesh's ``model`` axis. A shared tensor is split by KV head when
        every layer in it is an attention layer whose KV heads divide into ``model_shards`` and the page
        splits into equal whole words; otherwise it is replicated (e.g. one KV head, or a Mamba state).
        ``fp8_bytes``: hold fp8 pages in ``uint8`` words (``init_cache`` does on XLA:CPU).
        """
        if not isinstance(model_shards, int) or model_shards < 1:
            raise ValueError(f"model_shards must be a positive integer, got {model_shards!r}")
        slots: dict[str, LayerSlot] = {}
        for g in config.groups:
            for i, name in enumerate(g.layer_names):
                tensor, part = g.slot_of(i)
                slots[name] = LayerSlot(tensor, g.group_id, g.spec, g.block_size, g.blocks_per_state,
                                        g.layers_per_slot, part)
        for name, target in config.kv_sharing:
            slots[name] = slots[target]
        layout = cls(config.num_blocks, config.page_size_bytes, config.group_size, tuple(slots.items()),
                     fp8_bytes=fp8_bytes)
        part = model_shards * layout.word_bytes  # a part of a page is whole words

        def splits(t: int) -> bool:  # not a tensor of shared slots: a page's parts are its layers, not heads
            return layout.page_size_bytes % part == 0 and all(
                s.spec.paged_kv and s.spec.num_kv_heads % model_shards == 0
                and s.used_bytes % part == 0 and s.layers_per_slot == 1 for s in slots.values() if s.tensor == t)

        return replace(layout, shards=tuple(model_shards if model_shards > 1 and splits(t) else 1
                                            for t in range(layout.num_tensors)))

    def tensor_shards(self, t: int) -> int:
        """Parts of a page of shared tensor ``t`` (1: not split)."""
        return self.shards[t] if self.shards else 1

    def bytes_per_device(self) -> int:
        """KV memory one device of the ``model`` axis holds: split tensors count one part of each page."""
        return sum(self.num_blocks * self.page_size_bytes // self.tensor_shards(t) for t in range(self.num_tensors))

    def slot(self, layer: str) -> LayerSlot:
        """The slot of ``layer``; ``KeyError`` naming the known layers if absent."""
        for name, s in self.slots:
            if name == layer:
                return s
        raise KeyError(f"layer {layer!r} has no KV cache; known: {', '.join(n for n, _ in self.slots)}")

    @property
    def word_dtype(self) -> jnp.dtype:
        """The buffers' element type: the attention layers' KV dtype when they all share one that divides
        the page, else the widest unsigned word that does (uint32, uint16 or uint8).

        Why the KV dtype: a layer's page view of such a buffer is a reshape, while a ``bitcast_convert``
        between word and KV dtype is a copy of the whole buffer on XLA:CPU (about a third of a Gemma 3
        270M decode step went to six of them).

        Except fp8 pages with ``fp8_bytes``: XLA:CPU has no fp8 gather or scatter, so its kernels gather and
        scatter fp8 pages as bytes (``kernels_pallas.reference.as_bits``). Over ``uint8`` words XLA folds
        the page view's bitcast into theirs; over fp8 words each layer's view became a copy of its pages, in
        each layer of each step (about a third of a Gemma 3 270M decode step with fp8 pages). The GPU and
        TPU kernels read the fp8 words themselves."""
        kv = {jnp.dtype(s.spec.dtype) for _, s in self.slots if s.spec.paged_kv}
        if len(kv) == 1 and self.page_size_bytes % next(iter(kv)).itemsize == 0:
            dtype = next(iter(kv))
            return jnp.dtype(jnp.uint8) if self.fp8_bytes and is_fp8(dtype) else dtype
        return jnp.dtype(next(w for b, w in _WORDS if self.page_size_bytes % b == 0))

    @property
    def word_bytes(self) -> int:
        """Bytes of one storage word (4, 2 or 1)."""
        return self.word_dtype.itemsize

    @property
    def page_words(self) -> int:
        """Storage words per page."""
        return self.page_size_bytes // self.word_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers (null block included)."""
        return self.num_tensors * self.num_blocks * self.page_size_bytes


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """The KV memory: ``buffers[i]`` is shared tensor ``i``, ``word[num_blocks, page_words]``.

    ``layout`` is static (part of the jit cache key, not traced).
    """

    buffers: tuple[jax.Array, ...]
    layout: CacheLayout = field(metadata=dict(static=True))


def cache_shardings(layout: CacheLayout, mesh: jax.sharding.Mesh) -> tuple[jax.sharding.NamedSharding, ...]:
    """Per shared tensor: split over the mesh's ``model`` axis (its pages' parts) or replicated."""
    P = jax.sharding.PartitionSpec
    return tuple(jax.sharding.NamedSharding(mesh, P(None, "model") if layout.tensor_shards(t) > 1 else P())
                 for t in range(layout.num_tensors))


def init_cache(config: KVCacheConfig, mesh: jax.sharding.Mesh | None = None) -> KVCache:
    """Zero-filled buffers for ``config`` (zeros, not ``jnp.empty``: stale pages stay finite).

    With a ``mesh`` (axes ``model`` and optionally ``data``), tensors whose KV heads divide the ``model``
    axis are split by KV head over it (see ``CacheLayout.from_config``), the others replicated.
    """
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    layout = CacheLayout.from_config(config, model_shards=1 if mesh is None else mesh_model_size(mesh),
                                     fp8_bytes=platform == "cpu")
    shape = (layout.num_blocks, layout.page_words)
    devices = [None] * layout.num_tensors if mesh is None else cache_shardings(layout, mesh)
    return KVCache(tuple(jnp.zeros(shape, layout.word_dtype, device=d) for d in devices), layout)


def mesh_model_size(mesh) -> int:
    """The size of a mesh's ``model`` axis (1 without one); ``ValueError`` for axes other than data/model."""
    names = tuple(mesh.axis_names)
    if not set(names) <= {"data", "model"}:
        raise ValueError(f"mesh axes must be 'data' and/or 'model', got {names}")
    return dict(mesh.shape).get("model", 1)


# --- typed views ----------------------------------------------------------------------------


def _words_to(words: jax.Array, dtype) -> jax.Array:
    """Bitcast ``word[..., n]`` to ``dtype[..., m]`` (same bytes)."""
    dtype = jnp.dtype(dtype)
    if words.dtype == dtype:
        return words
    if words.dtype.itemsize == dtype.itemsize:
        return jax.lax.bitcast_convert_type(words, dtype)
    if words.dtype.itemsize > dtype.itemsize:
        out = jax.lax.bitcast_convert_type(words, dtype)  # [..., n, ratio]
        return out.reshape(*words.shape[:-1], -1)
    ratio = dtype.itemsize // words.dtype.itemsize
    return jax.lax.bitcast_convert_type(words.reshape(*words.shape[:-1], -1, ratio), dtype)


def _attention_view_shape(slot: LayerSlot) -> tuple[int, ...]:
    spec = slot.spec
    return (2, spec.num_kv_heads, slot.block_size, spec.head_size)


def _attention_slot(layout: CacheLayout, layer: str) -> LayerSlot:
    slot = layout.slot(layer)
    if not slot.spec.paged_kv:
        raise TypeError(f"layer {layer!r} is a Mamba layer; use read_mamba_state")
    return slot


def local_slot(slot: LayerSlot, shards: int) -> LayerSlot:
    """The slot as one device of ``shards`` sees it: its part of the KV heads."""
    return replace(slot, spec=replace(slot.spec, num_kv_heads=slot.spec.num_kv_heads // shards))


def page_view(buf: jax.Array, slot: LayerSlot, shards: int = 1) -> jax.Array:
    """``buf: word[N, W]`` (pages of ``shards`` parts) as ``dtype[N, 2, kv_heads, block_size, head_size]``
    (``[N * r, ...]`` for a layer sharing its slot with ``r - 1`` others: every part of every page)."""
    n = buf.shape[0]
    if slot.layers_per_slot > 1:
        typed = _words_to(buf, slot.spec.dtype)
        return typed.reshape(n * slot.layers_per_slot, *_attention_view_shape(slot))
    part = local_slot(slot, shards)
    typed = _words_to(buf.reshape(n, shards, -1), slot.spec.dtype)
    elems = part.used_bytes // dtype_bytes(slot.spec.dtype)
    if typed.shape[2] != elems:  # the layer is smaller than the page: the rest of each part is padding
        typed = typed[:, :, :elems]
    kv = typed.reshape(n, shards, *_attention_view_shape(part))
    if shards > 1:  # parts hold heads: [N, S, 2, H/S, ...] -> [N, 2, H, ...]
        kv = kv.transpose(0, 2, 1, 3, 4, 5)
    return kv.reshape(n, *_attention_view_shape(slot))


def store_page_view(buf: jax.Array, slot: LayerSlot, kv: jax.Array, shards: int = 1) -> jax.Array:
    """The inverse of ``page_view``: ``buf`` with the view's bytes written back (padding kept)."""
    n = buf.shape[0]
    if slot.layers_per_slot > 1:
        return _words_to(kv.reshape(n, -1), buf.dtype).reshape(buf.shape)
    part = local_slot(slot, shards)
    kv = kv.reshape(n, 2, shards, *_attention_view_shape(part)[1:])
    if shards > 1:
        kv = kv.transpose(0, 2, 1, 3, 4, 5)
    words = _words_to(kv.reshape(n, shards, -1), buf.dtype)
    if words.shape[2] != buf.shape[1] // shards:
        words = jax.lax.dynamic_update_slice(buf.reshape(n, shards, -1), words, (0, 0, 0))
    return words.reshape(buf.shape)


def layer_kv(cache: KVCache, layer: str) -> jax.Array:
    """The typed page view of an attention layer: ``dtype[num_blocks, 2, kv_heads, block_size, head_size]``
    (``num_blocks * layers_per_slot`` pages where layers share a slot: see ``part_pages``)."""
    slot = _attention_slot(cache.layout, layer)
    return page_view(cache.buffers[slot.tensor], slot, cache.layout.tensor_shards(slot.tensor))


def set_layer_kv(cache: KVCache, layer: str, kv: jax.Array) -> KVCache:
    """Store an attention layer's page view back (the inverse of ``layer_kv``); other bytes are kept."""
    layout = cache.layout
    slot = _attention_slot(layout, layer)
    expected = (layout.num_blocks * slot.layers_per_slot, *_attention_view_shape(slot))
    if kv.shape != expected or kv.dtype != jnp.dtype(slot.spec.dtype):
        raise ValueError(f"layer {layer!r}: view must be {slot.spec.dtype}{list(expected)}, "
                         f"got {kv.dtype}{list(kv.shape)}")
    buf = store_page_view(cache.buffers[slot.tensor], slot, kv, layout.tensor_shards(slot.tensor))
    return replace_buffer(cache, slot.tensor, buf)


def replace_buffer(cache: KVCache, i: int, buf: jax.Array) -> KVCache:
    """``cache`` with shared tensor ``i`` replaced by ``buf``."""
    bufs = list(cache.buffers)
    bufs[i] = buf
    return replace(cache, buffers=tuple(bufs))


# --- Mamba states ---------------------------------------------------------------------------


def _state_fields(spec: MambaSpec) -> list[tuple[int, int, tuple[int, ...], str]]:
    """(byte offset, byte size, shape, dtype) of each state tensor, packed in order."""
    out, off = [], 0
    for shape, dt in zip(spec.shapes, spec.dtypes):
        size = math.prod(shape) * dtype_bytes(dt)
        out.append((off, size, shape, dt))
        off += size
    return out


def _mamba_slot(layout: CacheLayout, layer: str, block_ids: jax.Array) -> LayerSlot:
    slot = layout.slot(layer)
    if not slot.spec.recurrent:
        raise TypeError(f"layer {layer!r} is not a Mamba layer")
    if block_ids.ndim != 2 or block_ids.shape[1] != slot.blocks_per_state:
        raise ValueError(f"layer {layer!r}: block_ids must be [requests, {slot.blocks_per_state}], "
                         f"got {list(block_ids.shape)}")
    return slot


def read_mamba_state(cache: KVCache, layer: str,
                     block_ids: jax.Array) -> tuple[jax.Array, ...]:
    """The states of a Mamba layer for ``block_ids: i32[R, blocks_per_state]``: one ``dtype[R, *shape]`` per
    state tensor."""
    slot = _mamba_slot(cache.layout, layer, block_ids)
    pages = cache.buffers[slot.tensor][block_ids]                      # word[R, k, W]
    raw = _words_to(pages, jnp.uint8).reshape(block_ids.shape[0], -1)  # u8[R, k * page bytes]
    return tuple(
        _words_to(raw[:, off:off + size], dt).reshape(-1, *shape)
        for off, size, shape, dt in _state_fields(slot.spec)
    )


def write_mamba_state(cache: KVCache, layer: str, block_ids: jax.Array,
                      states: Sequence[jax.Array], valid: jax.Array | None = None) -> KVCache:
    """Write Mamba states (as ``read_mamba_state`` returns them) to their pages.

    Rows with ``valid`` False (or a null block id 0) are not written.
    """
    layout = cache.layout
    slot = _mamba_slot(layout, layer, block_ids)
    fields = _state_fields(slot.spec)
    if len(states) != len(fields):
        raise ValueError(f"layer {layer!r}: {len(fields)} state tensors expected, got {len(states)}")
    r, k = block_ids.shape
    parts = []
    for (off, size, shape, dt), st in zip(fields, states):
        if st.shape != (r, *shape):
            raise ValueError(f"layer {layer!r}: state must be [{r}, {', '.join(map(str, shape))}], "
                             f"got {list(st.shape)}")
        parts.append(_words_to(st.astype(dt).reshape(r, -1), jnp.uint8))
    page_bytes = layout.page_size_bytes
    buf = cache.buffers[slot.tensor]
    # Bytes of the last page past the state keep their old value.
    old = _words_to(buf[block_ids], jnp.uint8).reshape(r, -1)
    raw = jnp.concatenate(parts + [old[:, slot.used_bytes:]], axis=1)
    words = _words_to(raw.reshape(r, k, page_bytes), buf.dtype)
    keep = block_ids != 0
    if valid is not None:
        keep &= valid[:, None]
    target = jnp.where(keep, block_ids, layout.num_blocks)  # out of range: dropped
    return replace_buffer(cache, slot.tensor, buf.at[target].set(words, mode="drop"))


# --- slot mapping ---------------------------------------------------------------------------


def part_pages(slot: LayerSlot, block_table: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A layer's block table and slot mapping in its page view, from its group's (``block_table``: block
    ids, ``slots``: ``block * block_size + offset``, -1 for none). The identity unless the layer shares its
    page slot: then block ``b`` is page ``b * r + part`` of the view (``page_view``)."""
    r, bs = slot.layers_per_slot, slot.block_size
    if r == 1:
        return block_table, slots
    return (block_table * r + slot.part,
            jnp.where(slots >= 0, (slots // bs * r + slot.part) * bs + slots % bs, -1).astype(jnp.int32))


def slot_mapping(block_table: jax.Array, positions: jax.Array, block_size: int,
                 valid: jax.Array | None = None) -> jax.Array:
    """Physical slots ``page * block_size + offset`` of token ``positions`` through a block table.

    ``block_table: i32[max_blocks]`` (one request) or ``i32[T, max_blocks]`` (one row per
    token); ``positions: i32[T]``. Slots are -1 where ``valid`` is False or the
    position's block is the null block (nothing is written there).
    """
    idx = positions // block_size
    if block_table.ndim == 1:
        page = jnp.take(block_table, idx, mode="fill", fill_value=0)
    else:
        page = jnp.take_along_axis(block_table, idx[:, None], axis=1, mode="fill", fill_value=0)[:, 0]
    ok = page > 0
    if valid is not None:
        ok &= valid
    return jnp.where(ok, page * block_size + positions % block_size, -1).astype(jnp.int32)

