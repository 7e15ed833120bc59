"""Per-type rules in jnp (skipped tokens, longest cache hit) and the coordinator's fixed point.

Each attention type's hit rule (``SEMANTICS.md``, "Prefix cache") is written
over a ``found`` matrix, the cached block of every (group, block index), so a
lookup is one batched probe of the prefix-cache table followed by a few
vectorised scans; no Python per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hkv_jax.allocator import prefix_cache as pc
from hkv_jax.allocator.state import AllocatorState, Layout
from hkv_jax.planner import cdiv
from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec


def skipped_tokens(spec, num_computed: jax.Array) -> jax.Array:
    """Tokens whose blocks a group of ``spec`` no longer needs after ``num_computed`` tokens."""
    if isinstance(spec, SlidingWindowSpec):
        return jnp.maximum(0, num_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return num_computed - 1
    return jnp.zeros_like(num_computed)


def _first_false(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """Smallest index >= start where ``mask`` is False (len(mask) if none)."""
    idx = jnp.arange(mask.shape[0])
    return jnp.min(jnp.where((idx >= start) & ~mask, idx, mask.shape[0]))


def _hit_one(spec, bs: int, found: jax.Array, all_found: jax.Array, max_len: jax.Array):
    """Longest hit of one spec group within ``max_len`` tokens.

    ``found``: ``i32[k, H]`` cached block per group of the spec group and block
    index (0 = miss); ``all_found``: ``bool[H]`` every group hits. Returns
    (blocks ``i32[k, H]`` with 0 where no block is needed, hit length in tokens).
    """
    H = all_found.shape[0]
    idx = jnp.arange(H)
    nmax = max_len // bs
    if isinstance(spec, SlidingWindowSpec):
        need = max(cdiv(spec.sliding_window - 1, bs), 1)
        last_miss = jax.lax.cummax(jnp.where(all_found, -1, idx))
        run = idx - last_miss  # consecutive hits ending at each index
        ends = (run >= need) & (idx < nmax)
        best = jnp.max(jnp.where(ends, idx, -1))
        lead = jnp.minimum(_first_false(all_found), nmax)
        nblocks = jnp.where(best >= 0, best + 1, lead)
        lo = jnp.where(best >= 0, best + 1 - need, 0)
        keep = (idx >= lo) & (idx < nblocks)
    elif isinstance(spec, MambaSpec):
        best = jnp.max(jnp.where(all_found & (idx < nmax), idx, -1))
        nblocks = best + 1
        keep = idx == best
    else:
        start = 0
        if isinstance(spec, ChunkedLocalSpec):
            start = jnp.where(max_len > 0, max_len // spec.attention_chunk_size * spec.attention_chunk_size // bs, 0)
        nblocks = jnp.minimum(_first_false(all_found, start), nmax)
        keep = (idx >= start) & (idx < nblocks)
    return jnp.where(keep[None, :], found, 0), nblocks * bs


def lookup(layout: Layout, state: AllocatorState, slot: jax.Array, key_slots: jax.Array | None = None):
    """Longest prefix-cache hit of the waiting request in ``slot``; ``key_slots: i32[G, H]``, optional:
    the cache entry ids of its keys (``prefix_cache.row_entries``), when the caller already looked them up.

    Returns (hit blocks ``i32[G, H]`` (entries past the hit are 0), hit tokens,
    shared-prefix boundary: a longer prefix some group alone could serve, or 0).
    """
    bs, G = layout.block_size, layout.num_groups
    hashes = state.hashes[slot]  # u32[H, 4]
    H = hashes.shape[0]
    nh = state.num_tokens[slot] // bs
    valid = jnp.arange(H) < nh
    if key_slots is None:  # one probe per hash: its slot holds every group's entry
        key_slots = pc.row_entries(state.bp.cache, pc.find_slots(state.bp.cache, hashes)).T
    found = pc.block_at(state.bp.cache, key_slots)
    found = jnp.where(valid[None, :], found, 0)
    sgs = [(layout.groups[sg[0]].spec, list(sg)) for sg in layout.spec_groups]
    all_found = [jnp.all(found[jnp.array(sg)] > 0, axis=0) for _, sg in sgs]

    blocks = jnp.zeros((G, H), jnp.int32)
    hit = state.num_tokens[slot] - 1
    cur = hit
    longest = jnp.int32(0)
    full_len = {}
    # First pass: every spec group computes its hit (full attention first).
    for k, (spec, sg) in enumerate(sgs):
        b, cur = _hit_one(spec, bs, found[jnp.array(sg)], all_found[k], cur)
        blocks = blocks.at[jnp.array(sg)].set(b)
        longest = jnp.maximum(longest, cur)
        if isinstance(spec, FullAttentionSpec):
            full_len[k] = cur

    def one_pass(carry):
        hit, cur, longest, blocks = carry
        hit = cur
        for k, (spec, sg) in enumerate(sgs):
            if k in full_len:
                cur = jnp.minimum(cur, full_len[k])
                continue
            b, cur = _hit_one(spec, bs, found[jnp.array(sg)], all_found[k], cur)
            blocks = blocks.at[jnp.array(sg)].set(b)
            longest = jnp.maximum(longest, cur)
        return hit, cur, longest, blocks

    if not layout.simple_hybrid:
        # Repeat until no type shrinks the candidate (the fixed point); lengths only decrease.
        hit, cur, longest, blocks = jax.lax.while_loop(
            lambda c: c[1] < c[0], one_pass, (hit, cur, longest, blocks)
        )
    hit = cur
    blocks = jnp.where(jnp.arange(H)[None, :] < hit // bs, blocks, 0)
    boundary = jnp.where(longest > hit, longest, 0)
    return blocks, hit, boundary
