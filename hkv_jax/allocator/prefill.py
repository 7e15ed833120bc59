"""Batched first schedules of waiting requests: one lookup for all, one pop for every new block, one cache insert."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.allocator import block_pool, free_queue, prefix_cache
from hkv_jax.allocator.coordinator import cached_this_step, fit_width, lookup, schedule_batch, token_counts
from hkv_jax.allocator.managers import allocation, skipped_tokens
from hkv_jax.allocator.state import RUNNING, WAITING, AllocatorState, Layout, cond_mutable, counter

# Distinct hit lengths up to which ``computes_shared_block`` sorts; past them it compares all pairs.
SORTED_HIT_LENGTHS = 8


def computes_shared_block(hashes: jax.Array, nhit: jax.Array, nfull: jax.Array) -> jax.Array:
    """Whether two requests of a prefill compute a block with the same hash (the later one would hit the
    earlier one's). ``hashes: u32[B, H, 4]`` their block hashes; request ``i`` computes (and caches)
    the blocks keyed by hashes ``nhit[i]`` to ``nfull[i] - 1`` (hash units).

    Requests ``i`` and ``j`` share a computed block iff their hashes agree at ``max(nhit_i, nhit_j)``
    (hashes chain: agreeing at a block means agreeing at every block before it). All ``B * B`` pairs
    are only compared when a cheap test finds a candidate: for each distinct hit length ``v`` (at most
    ``SORTED_HIT_LENGTHS`` of them: no hits, or a shared prefix, the usual batch), one sort of the
    31-bit prefixes of the hashes at ``v`` of the requests computing block ``v``; no two equal means
    no shared block.
    """
    B, H = hashes.shape[:2]
    big = jnp.iinfo(jnp.int32).max
    lengths = jnp.sort(jnp.where(nhit < nfull, nhit, big))
    distinct = jnp.sum((lengths < big) & jnp.concatenate([jnp.ones(1, bool), lengths[1:] != lengths[:-1]]))

    def equal_prefixes_at(v):
        computes = (nhit <= v) & (v < nfull)
        # A one-operand sort: several times cheaper on CPU than sorting whole keys.
        none = jnp.uint32(0xFFFFFFFF)  # above every 31-bit prefix
        srt = jnp.sort(jnp.where(computes, hashes[:, jnp.minimum(v, H - 1), 0] >> 1, none))
        return jnp.any((srt[1:] == srt[:-1]) & (srt[1:] != none))

    def all_pairs():
        m = jnp.maximum(nhit[:, None], nhit[None, :])                       # [B, B]
        hm = hashes[jnp.arange(B)[:, None], jnp.minimum(m, H - 1)]           # [B, B, 4]: request i at m_ij
        same = jnp.all(hm == jnp.swapaxes(hm, 0, 1), axis=-1) & (m < nfull[:, None]) & (m < nfull[None, :])
        return jnp.any(same & ~jnp.eye(B, dtype=bool))

    candidate = jax.lax.cond(
        distinct <= SORTED_HIT_LENGTHS,
        lambda: jnp.any(jax.vmap(equal_prefixes_at)(jnp.unique(lengths, size=SORTED_HIT_LENGTHS, fill_value=big))),
        lambda: jnp.bool_(True))
    return jax.lax.cond(candidate, all_pairs, lambda: jnp.bool_(False))


def by_hash(layout: Layout, blocks: jax.Array, H: int) -> jax.Array:
    """``[..., G, H]``: ``blocks: [..., G, M]`` (by each group's block index) placed at the hash index that
    keys each block (``Layout.key_index``), 0 at hashes that key no block of the group."""
    if layout.one_block_size:
        return fit_width(blocks, H)
    M = blocks.shape[-1]
    at = []
    for g in range(layout.num_groups):
        k = layout.hashes_per_block(g)
        j = np.arange(H)
        at.append(np.where((j + 1) % k == 0, (j + 1) // k - 1, M))            # M: no block (filled with 0)
    at = jnp.asarray(np.stack(at))                                            # [G, H]
    return jnp.take_along_axis(blocks, jnp.broadcast_to(at, blocks.shape[:-1] + (H,)), axis=-1, mode="fill",
                               fill_value=0)


def prefill_batch(layout: Layout, state: AllocatorState, slots, num_tokens, fallback: bool = True, mask=None):
    """``schedule_batch`` for waiting requests (first schedule: prefix lookup + allocation + caching),
    vectorised over the batch: one lookup for every request, one pop for every new block, one
    batched cache insert.

    ``slots: i32[B]`` distinct, ``num_tokens: i32[B]`` (-1: all), ``mask: bool[B]`` (optional) the
    lanes that take part (the others change nothing and report zeros). Same state and results as
    ``schedule_batch`` when the requests are independent: every hit block is held by some
    request (no hit takes a block out of the free queue), no two requests of the batch share a
    block they compute (one would hit the other's block), every request gets its blocks, and no
    popped block's key has duplicates. Otherwise it falls back to ``schedule_batch``; with
    ``fallback`` (static) False it applies nothing instead (state unchanged, ``ok`` all False; the
    caller runs ``schedule_batch``), which keeps the program small (see ``decode_step``).
    Returns (state, ok ``bool[B]``, new tokens ``i32[B]``, cache-hit tokens ``i32[B]``, whether
    the vectorised path ran).
    """
    G, M, R = layout.num_groups, layout.max_blocks, layout.max_requests
    B = slots.shape[0]
    if mask is None:
        mask = jnp.ones(B, bool)
    at = jnp.where(mask, slots, R)                                            # dropped writes
    H = state.hashes.shape[1]
    idx = jnp.arange(M)
    hashes = state.hashes[slots]                                              # [B, H, 4]
    # Every block hash is looked up once (one slot holds every group's entry): the hit search and the
    # cache insert share it. Entries past the H hashed ones are never cached (full blocks number <= H).
    hash_slots = prefix_cache.find_slots(state.block_pool.prefix_cache, hashes)  # [B, H]
    key_slots = jnp.swapaxes(
        prefix_cache.row_entries(state.block_pool.prefix_cache, hash_slots), 1, 2
    )  # [B, G, H] entry ids
    hit_blocks, h, _ = jax.vmap(lambda s, f: lookup(layout, state, s, f))(slots, key_slots)  # [B, G, H]
    h = jnp.where(mask, h, 0)
    hits = fit_width(hit_blocks, M)                                           # [B, G, M]
    counts = state.counts[slots]                                              # [B, 3 + 4G]
    C, T = counter(counts, "num_computed"), counter(counts, "num_tokens")
    n, computed, main, need, cached = token_counts(layout, C, T, h, num_tokens)
    n = jnp.where(mask, n, 0)
    cached = jnp.where(mask, cached, h)                                       # masked lanes compute nothing
    bsz = jnp.array(layout.block_sizes, jnp.int32)
    nhit, nfull = h[:, None] // bsz, cached[:, None] // bsz                   # [B, G]

    rows, cnt, first, lens, last = [], [], [], [], []
    for g in range(G):
        skipped = skipped_tokens(layout.groups[g].spec, computed) // layout.block_sizes[g]
        rows.append(jnp.where((idx[None] >= skipped[:, None]) & (idx[None] < nhit[:, None, g]), hits[:, g], 0))
        c, f, length, ls = allocation(layout, g, nhit[:, g], main, need, jnp.full(B, -1, jnp.int32))
        cnt.append(jnp.where(mask, c, 0))
        first.append(f)
        lens.append(length)
        last.append(ls)
    rows, cnt, first = jnp.stack(rows, 1), jnp.stack(cnt, 1), jnp.stack(first, 1)  # [B, G, M], [B, G]
    rows = jnp.where(mask[:, None, None], rows, 0)
    total = jnp.sum(cnt)

    pool, cache = state.block_pool.free_queue, state.block_pool.prefix_cache
    held = pool.ref_count[rows] > 0
    mamba_g = jnp.array([layout.is_mamba(g) for g in range(G)])
    last_hit = jnp.take_along_axis(rows, jnp.maximum(nhit - 1, 0)[:, :, None], axis=2)[:, :, 0]  # [B, G]
    stale = mamba_g[None] & (nhit > 0) & cached_this_step(layout, state, last_hit)
    max_new = B * G * M
    pop = free_queue.pop_plan(pool, total, max_new)
    fast = (
        jnp.all((counter(counts, "status") == WAITING) | ~mask)
        & jnp.all((counter(counts, "table_len") == 0) | ~mask[:, None])
        & jnp.all((n > 0) | ~mask)
        & jnp.all(held | (rows == 0))
        & ~computes_shared_block(hashes, h // layout.hash_block_size, cached // layout.hash_block_size)
        & ~jnp.any(stale)
        & (total <= pool.num_free)
        & pop.enough
        & ~jnp.any(prefix_cache.needs_promotion(cache, pop.ids))
    )
    # New blocks in request, group, table order: entry j of (b, g) takes ids[offset + j - first].
    offset = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(B, G)
    k = idx[None, None] - first[:, :, None]
    fresh = (k >= 0) & (k < cnt[:, :, None])
    rows = jnp.where(fresh, pop.ids[jnp.clip(offset[:, :, None] + k, 0, max_new - 1)], rows)
    reachable = jnp.asarray(np.stack([layout.reachable(g, M) for g in range(G)]))
    new_cached = (idx[None, None] >= nhit[:, :, None]) & (idx[None, None] < nfull[:, :, None]) & (rows > 0) & reachable

    def vectorised(state: AllocatorState):
        touched = jnp.where(fresh, 0, rows)
        p = free_queue.pop_apply(state.block_pool.free_queue, pop, hold=False)
        # One reference per table entry: a popped block's count goes 0 -> 1, a hit block's up by one.
        p = replace(p, ref_count=p.ref_count.at[jnp.where(rows > 0, rows, layout.num_blocks)].add(1, mode="drop"))
        c = prefix_cache.evict_alone(block_pool.mark_hit(state.block_pool.prefix_cache, touched), pop.ids)
        # A hash the lookup found is gone if the pop evicted its slot's last entry: a tombstone now.
        found = jnp.where((hash_slots >= 0) & (c.used[jnp.maximum(hash_slots, 0)] > 0), hash_slots, -1)
        new_rows = jnp.swapaxes(by_hash(layout, jnp.where(new_cached, rows, 0), H), 1, 2)  # [B, H, G]: a row per hash
        c = prefix_cache.insert_rows(c, new_rows.reshape(B * H, G), hashes.reshape(-1, 4), found=found.reshape(-1))
        marked = jnp.where(new_cached & mamba_g[None, :, None], rows, 0)
        step_cached = state.step_cached.at[layout.step_cached_index(c, marked)].set(True, mode="drop")
        st = replace(
            state,
            block_pool=block_pool.BlockPool(free_queue=p, prefix_cache=c),
            step_cached=step_cached,
            tables=state.tables.at[at].set(rows, mode="drop"),
        ).with_counters(at, status=RUNNING, table_len=jnp.stack(lens, 1), num_cached=jnp.maximum(nhit, nfull),
                        last_state=jnp.stack(last, 1), num_computed=C + h + n)
        return st, (mask, n, h)

    def sequential(state: AllocatorState):
        if not fallback:
            return state, (jnp.zeros(B, bool), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32))
        st, ok, n_, h_ = schedule_batch(layout, state, slots, num_tokens, mask)
        return st, (ok, n_, h_)

    state, (ok, n, h) = cond_mutable(fast, vectorised, sequential, state)
    return state, ok, n, h, fast
