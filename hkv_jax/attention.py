"""The call a model layer makes: KV write + paged attention for that layer's group.

``make_metadata`` is built once per step (from the allocator's block tables)
and shared by every layer; ``attention(layer, q, k, v, cache, metadata)``
writes the layer's new K/V into its pages and attends over them. A layer
that shares another layer's KV (``KVSharingSpec``) passes ``k = v = None``
and reads its target's pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp

import kernels_pallas
from hkv_jax.cache import KVCache, layer_kv, set_layer_kv, slot_mapping
from hkv_jax.spec import ChunkedLocalSpec, SlidingWindowSpec
from kernels_pallas.reference import AttentionParams, query_positions


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer of one step needs to find its pages.

    ``query_start_loc: i32[S + 1]``, ``seq_lens: i32[S]`` (ragged batch, see
    ``kernels_pallas.reference``); per KV cache group ``g``:
    ``block_tables[g]: i32[S, max_blocks_g]`` and ``slot_mappings[g]: i32[T]``
    (-1: not written).
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: tuple[jax.Array, ...]
    slot_mappings: tuple[jax.Array, ...]


def make_metadata(cache: KVCache, block_tables: Sequence[jax.Array], query_start_loc: jax.Array,
                  seq_lens: jax.Array, num_tokens: int) -> AttentionMetadata:
    """Metadata for a ragged batch of ``num_tokens`` query tokens (jittable).

    ``block_tables[g]: i32[S, max_blocks]`` is group ``g``'s table per sequence.
    """
    sizes = {s.group_id: s.block_size for _, s in cache.layout.slots}
    if len(block_tables) != len(sizes):
        raise ValueError(f"{len(sizes)} KV cache groups but {len(block_tables)} block tables")
    seq, pos, valid = query_positions(query_start_loc, seq_lens, num_tokens)
    slots = tuple(
        slot_mapping(jnp.asarray(bt)[seq], pos, sizes[g], valid) for g, bt in enumerate(block_tables)
    )
    return AttentionMetadata(query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
                             tuple(jnp.asarray(bt, jnp.int32) for bt in block_tables), slots)


def layer_params(cache: KVCache, layer: str, *, sm_scale: float | None = None,
                 soft_cap: float | None = None) -> AttentionParams:
    """The attention options of ``layer``: window / chunk from its spec, scale and soft-cap from the model."""
    spec = cache.layout.slot(layer).spec
    return AttentionParams(
        sm_scale=sm_scale,
        sliding_window=spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
        chunk_size=spec.attention_chunk_size if isinstance(spec, ChunkedLocalSpec) else None,
        soft_cap=soft_cap,
    )


def attention(layer: str, q: jax.Array, k: jax.Array | None, v: jax.Array | None, cache: KVCache,
              metadata: AttentionMetadata, *, sinks: jax.Array | None = None,
              sm_scale: float | None = None, soft_cap: float | None = None,
              impl: str = "auto", interpret: bool = False) -> tuple[jax.Array, KVCache]:
    """KV write + ragged paged attention of ``layer``: ``(out [T, Hq, D], cache)``.

    ``q: [T, Hq, D]``; ``k, v: [T, Hkv, D]`` (``None`` for a KV-sharing layer).
    ``sinks: f32[Hq]`` are gpt-oss attention-sink logits. ``impl`` picks the
    kernel (``kernels_pallas``). Donate the cache in the enclosing jit so the
    write happens in place.
    """
    slot = cache.layout.slot(layer)
    kv = layer_kv(cache, layer)
    if (k is None) != (v is None):
        raise ValueError(f"layer {layer!r}: give both k and v, or neither (KV sharing)")
    if k is not None:
        kv = kernels_pallas.kv_write(kv, k, v, metadata.slot_mappings[slot.group_id],
                                     impl=impl, interpret=interpret)
        cache = set_layer_kv(cache, layer, kv)
    out = kernels_pallas.paged_attention(
        q, kv, metadata.block_tables[slot.group_id], metadata.query_start_loc, metadata.seq_lens,
        layer_params(cache, layer, sm_scale=sm_scale, soft_cap=soft_cap), sinks,
        impl=impl, interpret=interpret)
    return out, cache
