"""vLLM's single-type managers in jnp: each KV cache group type's rules, written once.

For a group of a given spec: which tokens it no longer needs
(``skipped_tokens``), which table entries a request releases as it advances
(``release_row``), how many new blocks it takes and where they go
(``allocation``), and its prefix-cache hit rule (``hit_blocks``). The
coordinator (``coordinator.py``) combines the groups of a model; the batched
steps (``prefill.py``, ``decode.py``) broadcast or vmap the same functions over
requests. Every function is shape-polymorphic in its per-request arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hkv_jax.allocator.state import Layout
from hkv_jax.planner import cdiv
from hkv_jax.spec import ChunkedLocalSpec, MambaSpec, SlidingWindowSpec


def skipped_tokens(spec, num_computed: jax.Array) -> jax.Array:
    """Tokens whose blocks a group of ``spec`` no longer needs after ``num_computed`` tokens."""
    if isinstance(spec, SlidingWindowSpec):
        return jnp.maximum(0, num_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return num_computed - 1
    return jnp.zeros_like(num_computed)


def eviction_order(row: jax.Array, lo, hi) -> jax.Array:
    """Entries ``row[hi-1], row[hi-2], ..., row[lo]`` then zeros: the order one free call releases them in."""
    idx = jnp.arange(row.shape[0])
    pos = hi - 1 - idx
    return jnp.where(pos >= lo, row[jnp.clip(pos, 0, row.shape[0] - 1)], 0)


def release_row(layout: Layout, g: int, row, length, retired, last_state, computed):
    """Group ``g``'s table row (``i32[M]``, ``length`` entries) after dropping the blocks it no longer
    needs once ``computed`` tokens are computed (they become the null block).

    Returns (row, retired, released ``i32[2, M]``): the blocks to release as up to two free calls in
    order (the second only for a Mamba group's previous state block).
    """
    spec, bs = layout.groups[g].spec, layout.block_sizes[g]
    idx = jnp.arange(row.shape[0])
    skip = skipped_tokens(spec, computed)
    sb = jnp.where(skip > 0, jnp.minimum(skip // bs, length), 0)
    if isinstance(spec, MambaSpec):
        freed = eviction_order(row, retired, sb)
        row = jnp.where((idx >= retired) & (idx < sb), 0, row)
        retired = jnp.where(retired < sb, sb, retired)
        ls = last_state
        drop = (ls >= 0) & (ls < cdiv(computed, bs) - 1) & (row[jnp.maximum(ls, 0)] != 0)
        second = jnp.zeros_like(row).at[0].set(jnp.where(drop, row[jnp.maximum(ls, 0)], 0))
        row = jnp.where(drop & (idx == ls), 0, row)
        return row, retired, jnp.stack([freed, second])
    # Walk back from the last skipped entry, stopping at the first null one (released earlier).
    last_null = jnp.max(jnp.where((idx < sb) & (row == 0), idx, -1))
    freed = eviction_order(row, last_null + 1, sb)
    row = jnp.where((idx > last_null) & (idx < sb), 0, row)
    return row, retired, jnp.stack([freed, jnp.zeros_like(row)])


def allocation(layout: Layout, g: int, held, main, need, last_state):
    """New blocks of group ``g`` for a request whose table holds ``held`` entries (its hit blocks
    included) and that will hold ``main`` tokens (``need``: ``main`` capped at ``max_model_len``).

    Returns (count, table index of the first new block, table length after, ``last_state`` after).
    Attention groups take a block for every token to hold (the skipped ones are nulls already);
    a Mamba group takes one block, the state after the last block boundary, and remembers the
    previous state block (released once the next is computed).
    """
    bs = layout.block_sizes[g]
    if layout.is_mamba(g):
        required = cdiv(main, bs)
        grow = required > held
        return (grow.astype(jnp.int32), required - 1, jnp.where(grow, required, held),
                jnp.where(grow & (held > 0), held - 1, last_state))
    count = jnp.maximum(cdiv(need, bs) - held, 0)
    return count, held, held + count, last_state


def _first_false(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """Smallest index >= start where ``mask`` is False (len(mask) if none)."""
    idx = jnp.arange(mask.shape[0])
    return jnp.min(jnp.where((idx >= start) & ~mask, idx, mask.shape[0]))


def hit_blocks(spec, bs: int, unit: int, found: jax.Array, all_found: jax.Array, max_len: jax.Array):
    """Longest hit of one spec group (block size ``bs``) within ``max_len`` tokens, ending on a multiple
    of ``unit`` tokens (the scheduling unit: the lcm of every group's block size).

    ``found``: ``i32[k, H]`` cached block per group of the spec group and block
    index (0 = miss); ``all_found``: ``bool[H]`` every group hits. Returns
    (blocks ``i32[k, H]`` with 0 where no block is needed, hit length in tokens).
    """
    H = all_found.shape[0]
    idx = jnp.arange(H)
    nmax = max_len // bs
    segment = unit // bs  # blocks per scheduling unit
    if isinstance(spec, SlidingWindowSpec):
        need = max(cdiv(spec.sliding_window - 1, bs), 1)
        last_miss = jax.lax.cummax(jnp.where(all_found, -1, idx))
        run = idx - last_miss  # consecutive hits ending at each index
        ends = (run >= need) & (idx < nmax) & ((idx + 1) % segment == 0)
        best = jnp.max(jnp.where(ends, idx, -1))
        lead = jnp.minimum(_first_false(all_found), nmax) // segment * segment
        nblocks = jnp.where(best >= 0, best + 1, lead)
        lo = jnp.where(best >= 0, best + 1 - need, 0)
        keep = (idx >= lo) & (idx < nblocks)
    elif isinstance(spec, MambaSpec):
        best = jnp.max(jnp.where(all_found & (idx < nmax) & ((idx + 1) % segment == 0), idx, -1))
        nblocks = best + 1
        keep = idx == best
    else:
        start = 0
        if isinstance(spec, ChunkedLocalSpec):
            start = jnp.where(max_len > 0, max_len // spec.attention_chunk_size * spec.attention_chunk_size // bs, 0)
        nblocks = jnp.minimum(_first_false(all_found, start), nmax) // segment * segment
        keep = (idx >= start) & (idx < nblocks)
    return jnp.where(keep[None, :], found, 0), nblocks * bs
