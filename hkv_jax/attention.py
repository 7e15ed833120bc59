"""The call a model layer makes: KV write + paged attention for that layer's group.

``make_metadata`` is built once per step (from the allocator's block tables)
and shared by every layer; ``attention(layer, q, k, v, cache, metadata)``
writes the layer's new K/V into its pages and attends over them. A layer
that shares another layer's KV (``KVSharingSpec``) passes ``k = v = None``
and reads its target's pages.

Under a mesh with a ``model`` axis (``jax.set_mesh``), a layer whose KV is
split by KV head (``CacheLayout.shards``) runs its KV write and attention
under ``shard_map``, each device on its own heads' part of every page; a
layer with one KV head (replicated) still splits its query heads. Other
layers run replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp

import kernels_pallas
from hkv_jax.cache import (
    KVCache,
    LayerSlot,
    layer_kv,
    local_slot,
    page_view,
    part_pages,
    replace_buffer,
    set_layer_kv,
    slot_mapping,
    store_page_view,
)
from hkv_jax.planner import KVCacheConfig
from kernels_pallas.key_finish import KeyFinish
from kernels_pallas.positions import query_positions
from kernels_pallas.reference import AttentionParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer of one step needs to find its pages.

    ``query_start_loc: i32[S + 1]``, ``seq_lens: i32[S]`` (ragged batch, see
    ``kernels_pallas.reference``); per KV cache group ``g``:
    ``block_tables[g]: i32[S, max_blocks_g]`` and ``slot_mappings[g]: i32[T]``
    (-1: not written). ``record_positions`` (static): in a speculative step, the
    recurrent layers also record each sequence's state after each of its first
    ``record_positions`` tokens (``recurrent.commit_accepted`` writes back the one
    verification accepted); 0 records nothing.
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: tuple[jax.Array, ...]
    slot_mappings: tuple[jax.Array, ...]
    record_positions: int = field(default=0, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        """The batch's query tokens ``T``. A model may run its dense layers on more rows (``real_tokens``)."""
        return self.slot_mappings[0].shape[0]


def make_metadata(cache: KVCache, block_tables: Sequence[jax.Array], query_start_loc: jax.Array,
                  seq_lens: jax.Array, num_tokens: int, record_positions: int = 0) -> AttentionMetadata:
    """Metadata for a ragged batch of ``num_tokens`` query tokens (jittable).

    ``block_tables[g]: i32[S, max_blocks]`` is group ``g``'s table per sequence;
    ``record_positions``: ``AttentionMetadata.record_positions``.
    """
    sizes = {s.group_id: s.block_size for _, s in cache.layout.slots}
    if len(block_tables) != len(sizes):
        raise ValueError(f"{len(sizes)} KV cache groups but {len(block_tables)} block tables")
    seq, pos, valid = query_positions(query_start_loc, seq_lens, num_tokens)
    slots = tuple(
        slot_mapping(jnp.asarray(bt)[seq], pos, sizes[g], valid) for g, bt in enumerate(block_tables)
    )
    return AttentionMetadata(query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
                             tuple(jnp.asarray(bt, jnp.int32) for bt in block_tables), slots, record_positions)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x`` with zero rows appended along its first axis up to ``rows``."""
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def real_tokens(f, metadata: AttentionMetadata, *rows: jax.Array | None) -> tuple:
    """``f(*rows)`` (a tuple) over the batch's ``metadata.num_tokens`` tokens. A model may give its layers
    more rows than that (it pads a single token to two on a GPU: ``models.layers.gemm_rows``): those are
    cut off before ``f`` (a recurrent layer's scan), and the first of ``f``'s results gets zero rows in
    their place after (``attention`` has its kernels write them: ``out_rows``)."""
    n, t = rows[0].shape[0], metadata.num_tokens
    if n == t:
        return f(*rows)
    first, *rest = f(*(None if r is None else r[:t] for r in rows))
    return (pad_rows(first, n), *rest)


def check_kernel(config: KVCacheConfig, impl: str, max_blocks: int) -> None:
    """Raise ``ValueError`` (one line) when attention kernel ``impl`` cannot serve a layer of ``config``: its
    block size, head size or KV dtype (``kernels_pallas.supports``; ``auto`` picks one that can), before
    anything compiles. ``max_blocks``: a block table's width."""
    if impl not in kernels_pallas.IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(kernels_pallas.IMPLS)}")
    for g in config.groups:
        if not g.spec.paged_kv or impl == "auto":
            continue
        shape = (config.num_blocks * g.layers_per_slot, 2, g.spec.num_kv_heads, g.block_size, g.spec.head_size)
        support = kernels_pallas.supports(impl, shape, g.spec.dtype, g.spec.num_kv_heads, max_blocks)
        if not support:
            raise ValueError(f"attention kernel {impl!r} cannot serve group {g.group_id} ({g.spec.kind}, "
                             f"{g.block_size} tokens per block): {support.reason} (impl 'auto' picks one "
                             f"that can)")


def layer_params(cache: KVCache, layer: str, *, sm_scale: float | None = None,
                 soft_cap: float | None = None) -> AttentionParams:
    """The attention options of ``layer``: window / chunk from its spec, scale and soft-cap from the model."""
    spec = cache.layout.slot(layer).spec
    return AttentionParams(
        sm_scale=sm_scale,
        sliding_window=spec.window,
        chunk_size=spec.chunk,
        soft_cap=soft_cap,
    )


def attention(layer: str, q: jax.Array, k: jax.Array | None, v: jax.Array | None, cache: KVCache,
              metadata: AttentionMetadata, *, k_head: int = 0, v_head: int = 0, k_finish: KeyFinish | None = None,
              sinks: jax.Array | None = None, sm_scale: float | None = None, soft_cap: float | None = None,
              impl: str = "auto", interpret: bool = False) -> tuple[jax.Array, KVCache]:
    """KV write + ragged paged attention of ``layer``: ``(out [T, Hq, D], cache)``.

    ``q: [T, Hq, D]``; ``k`` and ``v`` (``None`` for a KV-sharing layer): the keys are heads
    ``[k_head, k_head + Hkv)`` of ``k: [T, H, D]`` and the values heads ``[v_head, v_head + Hkv)`` of
    ``v`` (their first ``T`` rows where they have more), so a model may pass its fused QKV product's output,
    which the KV write then reads in place. ``k_finish``: those keys are raw, and the write finishes them
    (``kernels_pallas.KeyFinish``: RMSNorm, RoPE; on a GPU inside the write's kernel). Rows past
    ``metadata.num_tokens`` (a model's padding rows: ``real_tokens``) are padding tokens: not written,
    zeros out. ``sinks: f32[Hq]`` are gpt-oss attention-sink logits. ``impl`` picks the kernel
    (``kernels_pallas``). Donate the cache in the enclosing jit so the write happens in place.
    """
    # A model's padding rows: attention runs on the tokens' and its output has zeros in theirs (written by
    # the kernel's last pass: out_rows); k and v keep their rows, the KV write reads the first T.
    rows, q = q.shape[0], q[:metadata.num_tokens]
    slot = cache.layout.slot(layer)
    if (k is None) != (v is None):
        raise ValueError(f"layer {layer!r}: give both k and v, or neither (KV sharing)")
    params = layer_params(cache, layer, sm_scale=sm_scale, soft_cap=soft_cap)
    shards = cache.layout.tensor_shards(slot.tensor)
    table, slots = part_pages(slot, metadata.block_tables[slot.group_id], metadata.slot_mappings[slot.group_id])
    if _splits_heads(slot, shards, q.shape[1]):
        if k is not None:  # each device's heads, finished before the split
            t, hkv = q.shape[0], slot.spec.num_kv_heads
            k, v = k[:t, k_head:k_head + hkv], v[:t, v_head:v_head + hkv]
            k = k if k_finish is None else k_finish.apply(k)
        return _sharded(slot, shards, q, k, v, cache, metadata, table, slots, sinks, params, impl, interpret, rows)
    if shards > 1:
        raise ValueError(f"layer {layer!r}: its KV is split {shards} ways but no mesh with a 'model' axis "
                         f"of that size is in use (jax.set_mesh)")
    # Replicated under a mesh: the pages stay whole on every device. Left to itself, GSPMD splits the KV
    # write by head after the split query heads, then all-gathers the layer's whole pages every step.
    whole = (lambda x: x) if jax.sharding.get_abstract_mesh().empty else (
        lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()))
    kv = whole(layer_kv(cache, layer))
    if k is not None:
        kv = whole(kernels_pallas.kv_write(kv, whole(k), whole(v), slots, k_head=k_head, v_head=v_head,
                                           k_finish=k_finish, impl=impl, interpret=interpret))
        cache = set_layer_kv(cache, layer, kv)
    out = kernels_pallas.paged_attention(q, kv, table, metadata.query_start_loc, metadata.seq_lens, params, sinks,
                                         impl=impl, interpret=interpret, out_rows=rows)
    return out, cache


def _splits_heads(slot: LayerSlot, shards: int, num_q_heads: int) -> bool:
    """Whether the layer's heads split over the mesh's ``model`` axis: when its KV is split by head, or
    when it has one KV head and its query heads divide (else it runs replicated)."""
    mesh = jax.sharding.get_abstract_mesh()
    size = 1 if mesh.empty else dict(mesh.shape).get("model", 1)
    return size > 1 and (shards == size or (slot.spec.num_kv_heads == 1 and num_q_heads % size == 0))


def _sharded(slot: LayerSlot, shards: int, q, k, v, cache: KVCache, metadata: AttentionMetadata, table, slots,
             sinks, params: AttentionParams, impl: str, interpret: bool, rows: int):
    """``attention`` under ``shard_map`` over the ``model`` axis: per device its query heads, and its
    KV heads' part of every page (or, with one replicated KV head, the whole page)."""
    P = jax.sharding.PartitionSpec
    heads = P(None, "model", None)
    kv_spec = heads if shards > 1 else P()
    part = local_slot(slot, shards)

    def local(buf, q, k, v, slots, table, starts, lens, sinks):
        kv = page_view(buf, part)
        if k is not None:
            kv = kernels_pallas.kv_write(kv, k, v, slots, impl=impl, interpret=interpret)
            buf = store_page_view(buf, part, kv)
        out = kernels_pallas.paged_attention(q, kv, table, starts, lens, params, sinks,
                                             impl=impl, interpret=interpret, out_rows=rows)
        return out, buf

    buf = cache.buffers[slot.tensor]
    pages = P(None, "model") if shards > 1 else P()
    # check_vma off: Pallas kernels do not track varying axes; the specs above say what varies.
    f = jax.shard_map(local, out_specs=(heads, pages), check_vma=False,
                      in_specs=(pages, heads, kv_spec, kv_spec, P(), P(), P(), P(), P("model")))
    out, buf = f(buf, q, k, v, slots, table, metadata.query_start_loc, metadata.seq_lens, sinks)
    return out, replace_buffer(cache, slot.tensor, buf)
