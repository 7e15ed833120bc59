"""The allocator's operations as pure functions ``state -> (state, result)``; jit them with ``layout`` static.

``schedule`` is vLLM's ``get_computed_blocks`` (for a waiting request) plus
``allocate_slots`` and ``cache_blocks``: all or nothing across groups (a
refused call changes nothing, except the out-of-window blocks a running
request releases first, as ``SEMANTICS.md`` says). Groups are unrolled in
Python (their rules are static); blocks and tables are arrays.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkv_jax.allocator import block_pool as BP
from hkv_jax.allocator import pool as P
from hkv_jax.allocator.hashing import SEED, block_hashes, hash_one_block
from hkv_jax.allocator.managers import lookup, skipped_tokens
from hkv_jax.allocator.state import EMPTY, RUNNING, WAITING, AllocatorState, Layout, counter, set_counters
from hkv_jax.spec import FullAttentionSpec

_NO_EXTRA = jnp.zeros(0, jnp.uint32)


def _cdiv(a, b: int):
    return (a + b - 1) // b


def _set_row(state: AllocatorState, slot, g: int, row, length=None, **rg) -> AllocatorState:
    """Replace request ``slot``'s table of group ``g`` (and its group counters ``rg``)."""
    if length is not None:
        rg["table_len"] = length
    state = _replace(state, tables=state.tables.at[slot, g].set(row))
    return state.with_counters(slot, g, **rg) if rg else state


_replace = replace  # states and pools are frozen dataclasses


def _reversed_range(row, lo, hi):
    """Entries ``row[hi-1], row[hi-2], ..., row[lo]`` then zeros (an eviction-order list)."""
    idx = jnp.arange(row.shape[0])
    pos = hi - 1 - idx
    return jnp.where(pos >= lo, row[jnp.clip(pos, 0, row.shape[0] - 1)], 0)


def add_request(layout: Layout, state: AllocatorState, slot, tokens, num_tokens, salt) -> AllocatorState:
    """Put a waiting request in ``slot``: ``tokens`` ``i32[T]`` (first ``num_tokens`` valid), cache salt ``u32``."""
    valid = jnp.arange(layout.max_model_len) < num_tokens
    tokens = jnp.where(valid, tokens, 0)
    salt = jnp.asarray(salt, jnp.uint32).reshape(1)
    hashes = block_hashes(tokens, layout.block_size, salt, _NO_EXTRA)
    state = _clear_tables(state, slot, status=WAITING, num_tokens=num_tokens, num_computed=0)
    return _replace(
        state,
        tokens=state.tokens.at[slot].set(tokens),
        salt=state.salt.at[slot].set(salt),
        hashes=state.hashes.at[slot].set(hashes),
    )


def append_token(layout: Layout, state: AllocatorState, slot, token) -> AllocatorState:
    """Append a sampled token; hash the block it fills, if it fills one."""
    bs = layout.block_size
    n = state.num_tokens[slot]
    tokens = state.tokens.at[slot, n].set(token)
    n1 = n + 1
    idx = jnp.maximum(n1 // bs - 1, 0)
    parent = jnp.where(idx > 0, state.hashes[slot, jnp.maximum(idx - 1, 0)], jnp.asarray(SEED))
    blk = jax.lax.dynamic_slice(tokens[slot], (idx * bs,), (bs,))
    h = hash_one_block(parent, blk, state.salt[slot], idx == 0, _NO_EXTRA)
    full = n1 % bs == 0
    hashes = jnp.where(full, state.hashes.at[slot, idx].set(h), state.hashes)
    return _replace(state, tokens=tokens, hashes=hashes).with_counters(slot, num_tokens=n1)


def _skip_row(layout: Layout, g: int, row, L, retired, last_state, computed):
    """Group ``g``'s table after dropping the blocks it no longer needs after ``computed`` tokens.

    Returns (row, retired, last_state, released ``i32[2, M]``): the blocks to release, as up to two
    ordered free calls (the second only for a Mamba group's previous state block).
    """
    spec, bs = layout.groups[g].spec, layout.block_size
    idx = jnp.arange(row.shape[0])
    skip = skipped_tokens(spec, computed)
    sb = jnp.where(skip > 0, jnp.minimum(skip // bs, L), 0)
    if layout.is_mamba(g):
        first = retired
        freed = _reversed_range(row, first, sb)
        row = jnp.where((idx >= first) & (idx < sb), 0, row)
        retired = jnp.where(first < sb, sb, first)
        ls = last_state
        drop = (ls >= 0) & (ls < _cdiv(computed, bs) - 1) & (row[jnp.maximum(ls, 0)] != 0)
        second = jnp.zeros_like(row).at[0].set(jnp.where(drop, row[jnp.maximum(ls, 0)], 0))
        row = jnp.where(drop & (idx == ls), 0, row)
        return row, retired, last_state, jnp.stack([freed, second])
    # Walk back from the last skipped entry, stopping at the first null one (released earlier).
    last_null = jnp.max(jnp.where((idx < sb) & (row == 0), idx, -1))
    freed = _reversed_range(row, last_null + 1, sb)
    row = jnp.where((idx > last_null) & (idx < sb), 0, row)
    return row, retired, last_state, jnp.stack([freed, jnp.zeros_like(row)])


def _remove_skipped(layout: Layout, state: AllocatorState, slot, g: int, computed) -> AllocatorState:
    """Release the blocks group ``g`` no longer needs after ``computed`` tokens (replaced by the null block)."""
    row, retired, _, released = _skip_row(layout, g, state.tables[slot, g], state.table_len[slot, g],
                                          state.retired[slot, g], state.last_state[slot, g], computed)
    bp = BP.free_blocks(BP.free_blocks(state.bp, released[0], front=layout.evicts_early(g)), released[1])
    return _set_row(_replace(state, bp=bp), slot, g, row, retired=retired)


def _cached_this_step(layout: Layout, state: AllocatorState, blocks: jax.Array) -> jax.Array:
    """Whether each of ``blocks`` is cached under an entry a Mamba group cached in this step."""
    if not layout.mamba_groups:
        return jnp.zeros(blocks.shape, bool)
    at = layout.step_cached_index(state.bp.cache, blocks)
    return state.step_cached.at[at].get(mode="fill", fill_value=False)


def _token_counts(layout: Layout, C, T, h, num_tokens):
    """Token arithmetic of a schedule (scalars or per request): ``C`` computed, ``T`` known, ``h`` hit
    tokens, ``num_tokens`` wanted (-1: all). Returns (new tokens ``n``, computed after the hit, tokens
    after the call, tokens to hold, full blocks after the call)."""
    remaining = T - C - h
    n = jnp.where(num_tokens < 0, remaining, jnp.minimum(num_tokens, remaining))
    computed = jnp.minimum(C + h, layout.max_model_len)
    main = computed + n
    bs = layout.block_size
    nfull = jnp.minimum(jnp.minimum(main, T), (T // bs) * bs) // bs
    return n, computed, main, jnp.minimum(main, layout.max_model_len), nfull


class ScheduleResult(NamedTuple):
    """What ``schedule`` reports (all arrays)."""

    ok: jax.Array  # bool[]
    num_new_tokens: jax.Array  # i32[]
    cache_hit_tokens: jax.Array  # i32[] (0 for a running request)
    shared_prefix_boundary: jax.Array  # i32[]
    hit_blocks: jax.Array  # i32[G, H]
    first_new: jax.Array  # i32[G]: table index of the first entry this call appended


def schedule(layout: Layout, state: AllocatorState, slot, num_tokens) -> tuple[AllocatorState, ScheduleResult]:
    """Allocate slots for up to ``num_tokens`` (-1: all) more tokens of the request in ``slot``."""
    bs, G, M = layout.block_size, layout.num_groups, layout.max_blocks
    waiting = state.status[slot] == WAITING
    H = state.hashes.shape[1]
    no_hit = (jnp.zeros((G, H), jnp.int32), jnp.int32(0), jnp.int32(0))
    hit_blocks, h, boundary = jax.lax.cond(waiting, lambda: lookup(layout, state, slot), lambda: no_hit)
    hits = jnp.pad(hit_blocks, ((0, 0), (0, M - H)))  # i32[G, M]
    C, T = state.num_computed[slot], state.num_tokens[slot]
    n, computed, main, need, nfull = _token_counts(layout, C, T, h, num_tokens)
    nhit = h // bs
    idx = jnp.arange(M)

    st = state
    for g in range(G):
        st = _remove_skipped(layout, st, slot, g, computed)

    ref = st.bp.pool.ref_count
    total = jnp.int32(0)
    impossible = jnp.bool_(False)
    for g in range(G):
        L = st.table_len[slot, g]
        hg = hits[g]
        free_hit = (hg > 0) & (ref[hg] == 0) & (idx < nhit)
        if layout.is_mamba(g):
            last = hg[jnp.maximum(nhit - 1, 0)]
            impossible |= waiting & (nhit > 0) & _cached_this_step(layout, st, last)
            new = _cdiv(main, bs) - nhit - L
            total += jnp.where(new > 0, 1, 0) + jnp.sum(free_hit, dtype=jnp.int32)
        else:
            required = _cdiv(need, bs)
            skipped = skipped_tokens(layout.groups[g].spec, computed) // bs
            wait_cnt = jnp.maximum(required - jnp.maximum(skipped, nhit + L), 0) + jnp.sum(
                free_hit & (idx >= jnp.maximum(0, skipped - L)), dtype=jnp.int32)
            total += jnp.where(waiting, wait_cnt, jnp.maximum(required - L, 0))
    ok = ~impossible & (total <= st.bp.pool.num_free) & (n > 0)

    def commit(st: AllocatorState) -> tuple[AllocatorState, jax.Array]:
        for g in range(G):
            skipped = skipped_tokens(layout.groups[g].spec, computed) // bs
            row = jnp.where((idx >= skipped) & (idx < nhit), hits[g], 0)
            st = _replace(st, bp=BP.touch(st.bp, jnp.where(waiting, row, 0)))
            st = _set_row(st, slot, g, jnp.where(waiting, row, st.tables[slot, g]),
                          jnp.where(waiting, nhit, st.table_len[slot, g]),
                          num_cached=jnp.where(waiting, nhit, st.num_cached[slot, g]))
        first_new = st.table_len[slot]
        for g in range(G):
            row, L = st.tables[slot, g], st.table_len[slot, g]
            if layout.is_mamba(g):
                required = _cdiv(main, bs)
                grow = required > L
                bp, ids = _pop(st.bp, jnp.where(grow, 1, 0), 1)
                row = jnp.where(grow & (idx == required - 1), ids[0], row)
                ls = jnp.where(grow & (L > 0), L - 1, st.last_state[slot, g])
                st = _set_row(_replace(st, bp=bp), slot, g, row, jnp.where(grow, required, L), last_state=ls)
            else:
                cnt = jnp.maximum(_cdiv(need, bs) - L, 0)
                bp, ids = _pop(st.bp, cnt, M)
                row = row.at[jnp.where(idx < cnt, L + idx, M)].set(ids, mode="drop")
                st = _set_row(_replace(st, bp=bp), slot, g, row, L + cnt)
        # Enter every newly filled block in the prefix cache (dense retention).
        hashes = jnp.pad(st.hashes[slot], ((0, M - H), (0, 0)))
        for g in range(G):
            row, before = st.tables[slot, g], st.num_cached[slot, g]
            new = jnp.where((idx >= before) & (idx < nfull), row, 0)
            bp = BP.cache_blocks(st.bp, row, hashes, jnp.int32(g), before, jnp.maximum(before, nfull))
            step_cached = st.step_cached
            if layout.is_mamba(g):
                step_cached = step_cached.at[layout.step_cached_index(bp.cache, new)].set(True, mode="drop")
            st = _replace(st, bp=bp, step_cached=step_cached).with_counters(
                slot, g, num_cached=jnp.maximum(before, nfull))
        st = st.with_counters(slot, status=RUNNING, num_computed=C + h + n)
        return st, first_new

    st, first_new = jax.lax.cond(ok, commit, lambda s: (s, s.table_len[slot]), st)
    return st, ScheduleResult(ok, n, h, boundary, hit_blocks, first_new)


def _pop(bp: BP.BlockPoolState, count, max_count: int):
    """``get_new_blocks``, skipped when nothing is wanted."""
    return jax.lax.cond(count > 0, lambda: BP.get_new_blocks(bp, count, max_count),
                        lambda: (bp, jnp.zeros(max_count, jnp.int32)))


def _clear_tables(state: AllocatorState, slot, **counters) -> AllocatorState:
    """Empty ``slot``'s tables (and set its request ``counters``)."""
    return _replace(state, tables=state.tables.at[slot].set(0)).with_counters(
        slot, table_len=0, num_cached=0, last_state=-1, retired=0, **counters)


def _release(layout: Layout, state: AllocatorState, slot, **counters) -> AllocatorState:
    """Free every block of ``slot``: group by group, each table last entry first (leading nulls skipped);
    its tables emptied and its request ``counters`` set."""
    bp = state.bp
    M = layout.max_blocks
    idx = jnp.arange(M)
    for g in range(layout.num_groups):
        row, L = state.tables[slot, g], state.table_len[slot, g]
        first = jnp.min(jnp.where((idx < L) & (row != 0), idx, M))
        bp = BP.free_blocks(bp, _reversed_range(row, first, L))
    return _clear_tables(_replace(state, bp=bp), slot, **counters)


def free(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a request's blocks and empty its slot."""
    return _release(layout, state, slot, status=EMPTY, num_tokens=0, num_computed=0)


def preempt(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a running request's blocks; it waits again with its tokens kept."""
    return _release(layout, state, slot, status=WAITING, num_computed=0)


def fork(layout: Layout, state: AllocatorState, src, dst) -> AllocatorState:
    """Start request ``dst`` as a copy of ``src`` (parallel sampling, beam search).

    The child shares ``src``'s full blocks (their ref counts rise by one) and
    has computed exactly those tokens; the tokens of ``src``'s partial last
    block are recomputed by the child's next ``schedule`` into its own block,
    so no block is ever written by two requests. ``dst`` must be empty.
    Attention groups only (a Mamba state cannot be shared half-way).
    """
    if any(layout.is_mamba(g) for g in range(layout.num_groups)):
        raise ValueError("fork does not support Mamba groups")
    nfull = jnp.where(state.status[src] == RUNNING, state.num_computed[src] // layout.block_size, 0)
    keep = jnp.arange(layout.max_blocks) < nfull
    rows = jnp.where(keep, state.tables[src], 0)                       # i32[G, M]
    held = jnp.where(rows > 0, rows, layout.num_blocks).reshape(-1)
    pool = _replace(state.bp.pool, ref_count=state.bp.pool.ref_count.at[held].add(1, mode="drop"))
    copy = lambda a: a.at[dst].set(a[src])
    return _replace(
        state,
        bp=_replace(state.bp, pool=pool),
        tokens=copy(state.tokens), salt=copy(state.salt), hashes=copy(state.hashes),
        tables=state.tables.at[dst].set(rows),
    ).with_counters(dst, status=jnp.where(nfull > 0, RUNNING, WAITING), num_tokens=state.num_tokens[src],
                    num_computed=nfull * layout.block_size, table_len=nfull, last_state=-1, retired=0,
                    num_cached=jnp.minimum(state.num_cached[src], nfull))


def reset_prefix_cache(layout: Layout, state: AllocatorState) -> tuple[AllocatorState, jax.Array]:
    """Drop every cache entry if no block is held; returns (state, ok)."""
    ok = state.bp.pool.num_free == layout.num_blocks - 1
    fresh = BP.pc.reset(state.bp.cache)
    cache = jax.tree.map(lambda a, b: jnp.where(ok, a, b), fresh, state.bp.cache)
    return _replace(state, bp=BP.BlockPoolState(pool=state.bp.pool, cache=cache),
                    step_cached=jnp.where(ok, False, state.step_cached)), ok


def new_step(layout: Layout, state: AllocatorState) -> AllocatorState:
    """A scheduler step begins: Mamba states cached in the previous step may now serve hits."""
    del layout
    return _replace(state, step_cached=jnp.zeros_like(state.step_cached))


def add_batch(layout: Layout, state: AllocatorState, slots, tokens, num_tokens, salts) -> AllocatorState:
    """``add_request`` for each row (``tokens`` ``i32[B, T]``), in order, in one program."""
    def body(st, x):
        return add_request(layout, st, *x), None

    return jax.lax.scan(body, state, (slots, tokens, num_tokens, salts))[0]


def schedule_batch(layout: Layout, state: AllocatorState, slots, num_tokens):
    """``schedule`` for each request in order (one XLA program, same results as one call each).

    Returns (state, ok ``bool[B]``, new tokens ``i32[B]``, cache-hit tokens ``i32[B]``).
    """
    def body(st, x):
        st, r = schedule(layout, st, x[0], x[1])
        return st, (r.ok, r.num_new_tokens, r.cache_hit_tokens)

    state, (ok, n, h) = jax.lax.scan(body, state, (slots, num_tokens))
    return state, ok, n, h


# Distinct hit lengths up to which ``_computes_shared_block`` sorts; past them it compares all pairs.
_SORTED_HIT_LENGTHS = 8


def _computes_shared_block(hashes: jax.Array, nhit: jax.Array, nfull: jax.Array) -> jax.Array:
    """Whether two requests of a prefill compute a block with the same hash (the later one would hit the
    earlier one's). ``hashes: u32[B, H, 4]`` their block hashes; request ``i`` computes (and caches)
    blocks ``nhit[i]`` to ``nfull[i] - 1``.

    Requests ``i`` and ``j`` share a computed block iff their hashes agree at ``max(nhit_i, nhit_j)``
    (hashes chain: agreeing at a block means agreeing at every block before it). All ``B * B`` pairs
    are only compared when a cheap test finds a candidate: for each distinct hit length ``v`` (at most
    ``_SORTED_HIT_LENGTHS`` of them: no hits, or a shared prefix, the usual batch), one sort of the
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
        distinct <= _SORTED_HIT_LENGTHS,
        lambda: jnp.any(jax.vmap(equal_prefixes_at)(jnp.unique(lengths, size=_SORTED_HIT_LENGTHS, fill_value=big))),
        lambda: jnp.bool_(True))
    return jax.lax.cond(candidate, all_pairs, lambda: jnp.bool_(False))


def prefill_batch(layout: Layout, state: AllocatorState, slots, num_tokens, fallback: bool = True):
    """``schedule_batch`` for waiting requests (first schedule: prefix lookup + allocation + caching),
    vectorised over the batch: one lookup for every request, one pop for every new block, one
    batched cache insert.

    ``slots: i32[B]`` distinct, ``num_tokens: i32[B]`` (-1: all). Same state and results as
    ``schedule_batch`` when the requests are independent: every hit block is held by some
    request (no hit takes a block out of the free queue), no two requests of the batch share a
    block they compute (one would hit the other's block), every request gets its blocks, and no
    popped block's key has duplicates. Otherwise it falls back to ``schedule_batch``; with
    ``fallback`` (static) False it applies nothing instead (state unchanged, ``ok`` all False; the
    caller runs ``schedule_batch``), which keeps the program small (see ``decode_step``).
    Returns (state, ok ``bool[B]``, new tokens ``i32[B]``, cache-hit tokens ``i32[B]``, whether
    the vectorised path ran).
    """
    bs, G, M = layout.block_size, layout.num_groups, layout.max_blocks
    B = slots.shape[0]
    H = state.hashes.shape[1]
    idx = jnp.arange(M)
    hashes = state.hashes[slots]                                              # [B, H, 4]
    # Every block hash is looked up once (one slot holds every group's entry): the hit search and the
    # cache insert share it. Entries past the H hashed ones are never cached (full blocks number <= H).
    hash_slots = BP.pc.find_slots(state.bp.cache, hashes)                     # [B, H]
    key_slots = jnp.swapaxes(BP.pc.row_entries(state.bp.cache, hash_slots), 1, 2)  # [B, G, H] entry ids
    hit_blocks, h, _ = jax.vmap(lambda s, f: lookup(layout, state, s, f))(slots, key_slots)  # [B, G, H]
    hits = jnp.pad(hit_blocks, ((0, 0), (0, 0), (0, M - H)))               # [B, G, M]
    counts = state.counts[slots]                                              # [B, 3 + 4G]
    C, T = counter(counts, "num_computed"), counter(counts, "num_tokens")
    n, computed, main, need, nfull = _token_counts(layout, C, T, h, num_tokens)
    nhit = h // bs

    rows, cnt, first, lens, last = [], [], [], [], []
    for g in range(G):
        skipped = skipped_tokens(layout.groups[g].spec, computed) // bs
        rows.append(jnp.where((idx[None] >= skipped[:, None]) & (idx[None] < nhit[:, None]), hits[:, g], 0))
        if layout.is_mamba(g):
            required = _cdiv(main, bs)
            grow = required > nhit
            cnt.append(grow.astype(jnp.int32))
            first.append(required - 1)
            lens.append(jnp.where(grow, required, nhit))
            last.append(jnp.where(grow & (nhit > 0), nhit - 1, -1))
        else:
            cnt.append(jnp.maximum(_cdiv(need, bs) - nhit, 0))
            first.append(nhit)
            lens.append(nhit + cnt[-1])
            last.append(jnp.full(B, -1, jnp.int32))
    rows, cnt, first = jnp.stack(rows, 1), jnp.stack(cnt, 1), jnp.stack(first, 1)  # [B, G, M], [B, G]
    total = jnp.sum(cnt)

    pool, cache = state.bp.pool, state.bp.cache
    held = pool.ref_count[rows] > 0
    mamba_g = jnp.array([layout.is_mamba(g) for g in range(G)])
    last_hit = jnp.take_along_axis(rows, jnp.maximum(nhit - 1, 0)[:, None, None], axis=2)[:, :, 0]  # [B, G]
    stale = mamba_g[None] & (nhit[:, None] > 0) & _cached_this_step(layout, state, last_hit)
    max_new = B * G * M
    pop = P.pop_plan(pool, total, max_new)
    fast = (
        jnp.all(counter(counts, "status") == WAITING) & jnp.all(counter(counts, "table_len") == 0) & jnp.all(n > 0)
        & jnp.all(held | (rows == 0)) & ~_computes_shared_block(hashes, nhit, nfull) & ~jnp.any(stale)
        & (total <= pool.num_free) & pop.enough & ~jnp.any(BP.pc.needs_promotion(cache, pop.ids))
    )
    # New blocks in request, group, table order: entry j of (b, g) takes ids[offset + j - first].
    offset = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(B, G)
    k = idx[None, None] - first[:, :, None]
    fresh = (k >= 0) & (k < cnt[:, :, None])
    rows = jnp.where(fresh, pop.ids[jnp.clip(offset[:, :, None] + k, 0, max_new - 1)], rows)
    new_cached = (idx[None, None] >= nhit[:, None, None]) & (idx[None, None] < nfull[:, None, None]) & (rows > 0)

    def vectorised(state: AllocatorState):
        touched = jnp.where(fresh, 0, rows)
        p = P.pop_apply(state.bp.pool, pop, hold=False)
        # One reference per table entry: a popped block's count goes 0 -> 1, a hit block's up by one.
        p = replace(p, ref_count=p.ref_count.at[jnp.where(rows > 0, rows, layout.num_blocks)].add(1, mode="drop"))
        c = BP.pc.evict_alone(BP.mark_hit(state.bp.cache, touched), pop.ids)
        # A hash the lookup found is gone if the pop evicted its slot's last entry: a tombstone now.
        found = jnp.where((hash_slots >= 0) & (c.used[jnp.maximum(hash_slots, 0)] > 0), hash_slots, -1)
        new_rows = jnp.swapaxes(jnp.where(new_cached, rows, 0)[:, :, :H], 1, 2)  # [B, H, G]: a row per hash
        c = BP.pc.insert_rows(c, new_rows.reshape(B * H, G), hashes.reshape(-1, 4), found=found.reshape(-1))
        marked = jnp.where(new_cached & mamba_g[None, :, None], rows, 0)
        step_cached = state.step_cached.at[layout.step_cached_index(c, marked)].set(True, mode="drop")
        st = _replace(
            state,
            bp=BP.BlockPoolState(pool=p, cache=c),
            step_cached=step_cached,
            tables=state.tables.at[slots].set(rows),
        ).with_counters(slots, status=RUNNING, table_len=jnp.stack(lens, 1), num_cached=jnp.maximum(nhit, nfull)[:, None],
                        last_state=jnp.stack(last, 1), num_computed=C + h + n)
        return st, (jnp.ones(B, bool), n, h)

    def sequential(state: AllocatorState):
        if not fallback:
            return state, (jnp.zeros(B, bool), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32))
        st, ok, n_, h_ = schedule_batch(layout, state, slots, num_tokens)
        return st, (ok, n_, h_)

    state, (ok, n, h) = _cond_mutable(fast, vectorised, sequential, state)
    return state, ok, n, h, fast


def append_batch(layout: Layout, state: AllocatorState, slots, tokens) -> AllocatorState:
    """``append_token`` for each (slot, token), in order."""
    def body(st, x):
        return append_token(layout, st, x[0], x[1]), None

    return jax.lax.scan(body, state, (slots, tokens))[0]


class _Releases(NamedTuple):
    """The free calls of one step, one block at most each (``flat``: ids in call order, 0 = none)."""

    flat: jax.Array      # i32[K]
    now_free: jax.Array  # bool[K]: the call that drops the block's last reference
    to_front: jax.Array  # bool[K]: ... and the block is uncached (front of the queue)
    fits: jax.Array      # bool[]: the queue array has room without compaction


def _plan_releases(pool: P.BlockPool, cache, flat: jax.Array, early: jax.Array) -> _Releases:
    """Read-only: where the blocks of the free calls ``flat`` go (see ``_apply_releases``);
    ``early: bool[K]`` marks calls whose blocks go to the front even when cached."""
    N, K = pool.num_blocks, flat.shape[0]
    valid = flat > 0
    fb = jnp.where(valid, flat, 0)
    lane = jnp.arange(K, dtype=jnp.int32)
    # A block may be released by several calls (shared by requests): it is free after the last one.
    if K * 8 >= N:  # many calls: count them in pool-sized arrays (O(K + N))
        at = jnp.where(valid, flat, N)
        count = jnp.zeros(N, jnp.int32).at[at].add(1, mode="drop")
        drops = count[fb]
        is_last = jnp.full(N, -1, jnp.int32).at[at].max(lane, mode="drop")[fb] == lane
    else:  # few: runs of equal ids in a stable sort give each id's call count and last call (O(K log K))
        order = jnp.argsort(flat, stable=True)
        ids = flat[order]
        starts = jnp.concatenate([jnp.ones(1, bool), ids[1:] != ids[:-1]]) if K else jnp.zeros(0, bool)
        ends = jnp.concatenate([ids[1:] != ids[:-1], jnp.ones(1, bool)]) if K else jnp.zeros(0, bool)
        run_start = jax.lax.cummax(jnp.where(starts, lane, 0))
        run_end = jax.lax.cummin(jnp.where(ends, lane, K), reverse=True)
        drops = jnp.zeros(K, jnp.int32).at[order].set(run_end - run_start + 1)
        is_last = jnp.zeros(K, bool).at[order].set(ends)
    now_free = valid & (pool.ref_count[fb] == drops) & is_last
    to_front = now_free & ((cache.block_slot[fb] < 0) | (early & ~cache.hit[fb]))
    fits = pool.tail - pool.head + jnp.sum(now_free, dtype=jnp.int32) <= N
    return _Releases(flat, now_free, to_front, fits)


def _apply_releases(pool: P.BlockPool, rel: _Releases) -> P.BlockPool:
    """Drop one reference per free call: blocks reaching 0 go to the front (uncached; later calls in
    front of earlier ones) or the back (cached; in order), as one ``free_blocks`` per call would.
    Needs ``rel.fits`` (no compaction)."""
    N = pool.num_blocks
    flat, now_free, to_front = rel.flat, rel.now_free, rel.to_front
    to_back = now_free & ~to_front
    n_front, n_back = jnp.sum(to_front, dtype=jnp.int32), jnp.sum(to_back, dtype=jnp.int32)
    front_rank = jnp.cumsum(to_front[::-1], dtype=jnp.int32)[::-1] - 1
    new_pos = jnp.where(to_front, pool.head - n_front + front_rank,
                        pool.tail + jnp.cumsum(to_back, dtype=jnp.int32) - 1)
    return replace(
        pool,
        ref_count=pool.ref_count.at[jnp.where(flat > 0, flat, N)].add(-1, mode="drop"),
        queue=pool.queue.at[jnp.where(now_free, new_pos % N, N)].set(flat, mode="drop"),
        pos=pool.pos.at[jnp.where(now_free, flat, N)].set(new_pos, mode="drop"),
        head=pool.head - n_front, tail=pool.tail + n_back, num_free=pool.num_free + n_front + n_back)


class _DecodePlan(NamedTuple):
    """What a busy decode step does (``decode_step``), planned read-only."""

    branch: jax.Array     # i32[]: 1 vectorised, 2 vectorised with many releases, 3 sequential
    releases: _Releases   # the free calls of the vectorised branch (one block each)
    pop: P.PopPlan        # the new blocks
    new_block: jax.Array  # i32[B, G]: the new block of each (request, group), 0 = none
    blk: jax.Array        # i32[B, G]: the block this token filled
    todo: jax.Array       # bool[B, G]: ... and it enters the prefix cache
    keys: jax.Array       # u32[B, 4]: its block hash (the same block index in every group)


def decode_step(layout: Layout, state: AllocatorState, slots, fallback: bool = True):
    """Every request in ``slots`` (distinct, running) allocates slots for one more token: one vectorised program.

    Same state and results as ``schedule_batch(slots, 1)``, computed for all requests at once with
    updates proportional to the blocks that move, not to the pool or the tables. A step where no
    block moves (no request needs a block, fills one or releases one: most steps) only counts the
    token. Otherwise: the out-of-window releases of every (request, group) in call order, one pop
    from the queue head for all new blocks, then the cache inserts. That order equals vLLM's
    request-by-request order when the new blocks come from blocks already free before the step and
    no released block goes to the queue front (the steady state). Otherwise (a nearly full pool,
    uncached releases, a queue to compact, an evicted key with duplicates) it falls back to
    ``schedule_batch``. A busy step plans everything read-only first, so its branch updates the
    state in place.
    Returns (state, ok ``bool[B]``, the path taken ``i32[]``: 0 = only counted the token, 1 = vectorised,
    2 = vectorised with free calls releasing several blocks, 3 = sequential fallback).

    ``fallback`` (static) False leaves the fallback out of the program: path 3 then applies nothing
    (the state comes back unchanged, ``ok`` all False) and the caller runs ``schedule_batch(layout,
    state, slots, 1)`` itself. The program is much smaller, and on CPU a call's fixed cost grows with
    the program even where a branch never runs: the idle step takes half the time or less.
    On CPU a host loop does better still with ``idle_decode`` first (see there).
    """
    return _decode(layout, state, slots, fallback, count_only=False)


def idle_decode(layout: Layout, state: AllocatorState, slots) -> tuple[AllocatorState, jax.Array]:
    """Whether ``decode_step(layout, state, slots)`` would only count the token (path 0, the usual
    step), and the state it would leave then (else ``state`` itself).

    A host loop calls this first and, when the step is idle, takes the returned state; otherwise it
    calls ``decode_step``. It is jitted already (call it as it is: wrapping it in ``jax.jit`` again
    would pass the whole state in). Its program takes only the counters (and the block tables where a
    window group may release a block), returns the new counters and donates nothing: on CPU a call's
    fixed cost grows with every array passed in and out (full32 B = 256: 0.55-0.6 of the idle
    ``decode_step``'s time when it took the whole state; full32 B = 1024: 205 -> 166 us per step with
    the counters packed in one array instead of 8 separate arrays, ``benchmarks/README.md``).
    Returns ``(state, idle bool[])``.
    Inside one jitted serving step use ``decode_step``.
    """
    tables = state.tables if _release_groups(layout) else None
    counts, idle = _idle_decode(layout, _DecodeInputs(state.counts, tables), slots)
    return _replace(state, counts=counts), idle


class _DecodeInputs(NamedTuple):
    """What ``_decode`` reads before it knows whether the step is idle (shapes: ``AllocatorState``)."""

    counts: jax.Array
    tables: jax.Array | None  # None where no group releases blocks as tokens come (nothing to read)


def _release_groups(layout: Layout) -> list[int]:
    """The groups that may release blocks in a decode step (out of the window or chunk; Mamba states)."""
    return [g for g in range(layout.num_groups) if not isinstance(layout.groups[g].spec, FullAttentionSpec)]


@functools.partial(jax.jit, static_argnums=0)
def _idle_decode(layout: Layout, inputs: _DecodeInputs, slots):
    return _decode(layout, inputs, slots, False, count_only=True)


def _decode(layout: Layout, state: AllocatorState | _DecodeInputs, slots, fallback: bool, count_only: bool):
    """``decode_step``'s body; ``count_only``: ``idle_decode``'s answer (the new counts, idle), computed
    before anything busy (from the ``_DecodeInputs`` only)."""
    bs, G, M = layout.block_size, layout.num_groups, layout.max_blocks
    B = slots.shape[0]
    rows = state.counts[slots]                                               # [B, 3 + 4G]: one gather
    C, T = counter(rows, "num_computed"), counter(rows, "num_tokens")
    computed = jnp.minimum(C, layout.max_model_len)
    main = computed + 1
    need = jnp.minimum(main, layout.max_model_len)
    lens = counter(rows, "table_len")                                        # [B, G]
    retired, last_state = counter(rows, "retired"), counter(rows, "last_state")
    bidx = jnp.arange(B)
    idx_m = jnp.arange(M)

    # Out-of-window releases (full attention releases nothing): the zeroed entries and the free calls.
    # A window group's null entries form a prefix of its row, so after the step every entry below its
    # first needed block ``sb`` is null: one release per call iff entry ``sb - 2`` is already null.
    # That is O(B) per group; the wide form (several blocks per call) is only built when needed.
    zeroed, calls, after, cleared, retired_new, single = [], [], {}, {}, [], jnp.bool_(True)
    release_groups = _release_groups(layout)

    def wide_releases(tables, g):
        """Group ``g``'s rows after the step, retired indices and free calls ``i32[B, 2, M]`` (in order)."""
        return jax.vmap(lambda r, l, rt, ls, c: _skip_row(layout, g, r, l, rt, ls, c))(
            tables[slots, g], lens[:, g], retired[:, g], last_state[:, g], computed)

    for g in range(G):
        if g not in release_groups:
            retired_new.append(retired[:, g])
        elif layout.is_mamba(g):
            r, rt, _, rel = wide_releases(state.tables, g)
            retired_new.append(rt)
            after[g] = r
            single &= jnp.all(jnp.sum(rel > 0, axis=-1) <= 1)
            calls.append(jnp.max(rel, axis=-1))                              # [B, 2]: one id per free call
            changed = r != state.tables[slots, g]                            # at most 2 entries per row if single
            for j in (jnp.argmax(changed, axis=-1), M - 1 - jnp.argmax(changed[:, ::-1], axis=-1)):
                zeroed.append((g, j, jnp.any(changed, axis=-1)))
        else:
            skip = skipped_tokens(layout.groups[g].spec, computed)
            sb = jnp.where(skip > 0, jnp.minimum(skip // bs, lens[:, g]), 0)
            last, below = (state.tables[slots, g, jnp.maximum(sb - k, 0)] for k in (1, 2))
            freed = (sb > 0) & (last != 0)
            single &= jnp.all(~freed | (sb < 2) | (below == 0))
            retired_new.append(retired[:, g])
            cleared[g] = sb
            calls.append(jnp.stack([jnp.where(freed, last, 0), jnp.zeros_like(last)], 1))
            zeroed.append((g, sb - 1, freed))
    flat = jnp.stack(calls, 1).reshape(-1) if calls else jnp.zeros(0, jnp.int32)  # request, group, call order
    early_g = jnp.array([layout.evicts_early(g) for g in release_groups], bool)
    early = jnp.broadcast_to(early_g[None, :, None], (B, len(release_groups), 2)).reshape(-1)
    retired_new = jnp.stack(retired_new, 1)

    cnt, new_idx = [], []
    for g in range(G):
        if layout.is_mamba(g):
            required = _cdiv(main, bs)
            cnt.append((required > lens[:, g]).astype(jnp.int32))
            new_idx.append(required - 1)
        else:
            cnt.append(jnp.maximum(_cdiv(need, bs) - lens[:, g], 0))
            new_idx.append(lens[:, g])
    cnt, new_idx = jnp.stack(cnt, 1), jnp.stack(new_idx, 1)                  # [B, G], each count 0 or 1
    total = jnp.sum(cnt)
    nfull = jnp.minimum(jnp.minimum(C + 1, T), (T // bs) * bs) // bs
    before = counter(rows, "num_cached")                                     # [B, G]
    num_cached = jnp.maximum(before, nfull[:, None])
    running = jnp.all(counter(rows, "status") == RUNNING) & jnp.all(T - C >= 1)
    idle = (running & (total == 0) & jnp.all(num_cached == before) & jnp.all(flat == 0)
            & jnp.all(retired_new == retired))
    if count_only:
        return set_counters(state.counts, slots, num_computed=jnp.where(idle, C + 1, C)), idle

    def entry(tables, g, j):
        """Entry ``j`` of group ``g``'s row after the releases."""
        j = jnp.clip(j, 0, M - 1)
        if g in cleared:
            return jnp.where(j < cleared[g], 0, tables[slots, g, j])
        return after[g][bidx, j] if g in after else tables[slots, g, j]

    def wide_calls(tables):
        """Every release group's rows after the step, all free calls (request, group, call, entry order)
        and which go to the front early (built only in a busy step: ``B * G * 2 * M`` lanes)."""
        out = {g: wide_releases(tables, g) for g in release_groups}
        flat = jnp.stack([o[3] for o in out.values()], 1).reshape(-1)
        return {g: o[0] for g, o in out.items()}, flat, jnp.repeat(early, M)

    def make_plan(state: AllocatorState) -> _DecodePlan:
        pool, cache = state.bp.pool, state.bp.cache
        releases = _plan_releases(pool, cache, flat, early)
        # New blocks come from blocks free before the step (none released to the front when any is taken).
        pop = P.pop_plan(pool, total, B * G)
        vectorisable = (
            running & (total <= pool.num_free) & pop.enough
            & ~jnp.any(BP.pc.needs_promotion(cache, pop.ids)) & jnp.all(nfull[:, None] - before <= 1)
        )
        fast = vectorisable & single & releases.fits & ((total == 0) | ~jnp.any(releases.to_front))
        offset = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(B, G)
        new_block = jnp.where(cnt > 0, pop.ids[jnp.minimum(offset, B * G - 1)], 0)
        # The blocks this token filled: at most one per (request, group), cached in request then group order.
        blk = jnp.stack([jnp.where((cnt[:, g] > 0) & (new_idx[:, g] == before[:, g]), new_block[:, g],
                                   entry(state.tables, g, before[:, g])) for g in range(G)], 1)
        todo = (nfull[:, None] > before) & (blk > 0)
        # Vectorised, a block is cached only where before == nfull - 1: one hash per request.
        keys = state.hashes[slots, jnp.clip(nfull - 1, 0, state.hashes.shape[1] - 1)]  # [B, 4]
        many = jnp.bool_(False)
        if release_groups:
            # Free calls releasing several blocks (the first step after a long prefill): still vectorised
            # when every released block goes to the back of the queue.
            def many_ok():
                wide = _plan_releases(pool, cache, *wide_calls(state.tables)[1:])
                return wide.fits & ~jnp.any(wide.to_front)

            many = jax.lax.cond(vectorisable & ~single, many_ok, lambda: jnp.bool_(False))
        branch = jnp.where(fast, 1, jnp.where(many, 2, 3)).astype(jnp.int32)
        return _DecodePlan(branch, releases, pop, new_block, blk, todo, keys)

    mamba_g = jnp.array([layout.is_mamba(g) for g in range(G)])
    last_new = jnp.stack([jnp.where((cnt[:, g] > 0) & (lens[:, g] > 0), lens[:, g] - 1, last_state[:, g])
                          if layout.is_mamba(g) else last_state[:, g] for g in range(G)], 1)
    lens_new = jnp.stack([jnp.where(cnt[:, g] > 0, new_idx[:, g] + 1, lens[:, g]) if layout.is_mamba(g)
                          else lens[:, g] + cnt[:, g] for g in range(G)], 1)

    def count_token(state: AllocatorState):
        return state.with_counters(slots, num_computed=C + 1), (jnp.ones(B, bool), jnp.int32(0))

    def vectorised(state: AllocatorState, plan: _DecodePlan, releases: _Releases, rows_after: dict | None):
        p = P.pop_apply(_apply_releases(state.bp.pool, releases), plan.pop)
        c = BP.pc.evict_alone(state.bp.cache, plan.pop.ids)
        todo, blk = plan.todo, plan.blk
        c = BP.pc.insert_rows(c, jnp.where(todo, blk, 0), plan.keys)
        marked = jnp.where(todo & mamba_g[None, :], blk, 0)
        step_cached = state.step_cached.at[layout.step_cached_index(c, marked)].set(True, mode="drop")
        # Table entries: the released ones become null, the new block goes in.
        tables = state.tables.at[slots[:, None], jnp.arange(G)[None, :],
                                 jnp.where(cnt > 0, new_idx, M)].set(plan.new_block, mode="drop")
        if rows_after:  # released entries anywhere in the rows: write the release groups' rows whole
            for g, r in rows_after.items():
                keep = (idx_m[None, :] == jnp.where(cnt[:, g] > 0, new_idx[:, g], M)[:, None])
                tables = tables.at[slots, g].set(jnp.where(keep, tables[slots, g], r))
        else:
            for g, j, ok in zeroed:
                tables = tables.at[slots, g, jnp.where(ok, j, M)].set(0, mode="drop")
        st = _replace(
            state,
            bp=BP.BlockPoolState(pool=p, cache=c),
            step_cached=step_cached,
            tables=tables,
        ).with_counters(slots, table_len=lens_new, retired=retired_new, last_state=last_new, num_cached=num_cached,
                        num_computed=C + 1)
        return st, jnp.ones(B, bool)

    def many_releases(state: AllocatorState, plan: _DecodePlan):
        rows_after, wide_flat, wide_early = wide_calls(state.tables)
        rel = _plan_releases(state.bp.pool, state.bp.cache, wide_flat, wide_early)
        rel, state = jax.lax.optimization_barrier((rel, state))  # reads before writes, as in ``busy``
        return vectorised(state, plan, rel, rows_after)

    def sequential(state: AllocatorState):
        if not fallback:
            return state, jnp.zeros(B, bool)
        st, ok, _, _ = schedule_batch(layout, state, slots, jnp.ones(B, jnp.int32))
        return st, ok

    def busy(state: AllocatorState):
        """Plan (reads), then update in place: the barrier orders the reads before the writes,
        else XLA copies the pool and the cache in every branch."""
        plan = make_plan(state)
        plan, state = jax.lax.optimization_barrier((plan, state))
        fns = [lambda s: vectorised(s, plan, plan.releases, None), lambda s: many_releases(s, plan), sequential]
        index = plan.branch - 1
        if not release_groups:  # the branch is never 2: no many-release branch to compile
            fns, index = [fns[0], fns[2]], jnp.minimum(index, 1)
        st, ok = _switch_mutable(index, fns, state)
        return st, (ok, plan.branch)

    state, (ok, path) = _cond_mutable(idle, count_token, busy, state)
    return state, ok, path


# Fields a schedule never changes: kept out of ``lax.cond`` outputs, so XLA need not copy them.
_READ_ONLY = ("tokens", "salt", "hashes")


def _switch_mutable(index, fns, state: AllocatorState):
    """``lax.switch(index, fns, state)`` for functions returning ``(state, aux)`` whose
    ``_READ_ONLY`` fields are unchanged; only the other fields pass through the conditional."""
    def wrap(fn):
        def run(mutable):
            st, aux = fn(_replace(state, **mutable))
            return {f: getattr(st, f) for f in mutable}, aux
        return run

    mutable = {f: getattr(state, f) for f in state.__dataclass_fields__ if f not in _READ_ONLY}
    out, aux = jax.lax.switch(index, [wrap(f) for f in fns], mutable)
    return _replace(state, **out), aux


def _cond_mutable(pred, true_fn, false_fn, state: AllocatorState):
    """``lax.cond`` form of ``_switch_mutable``."""
    return _switch_mutable(jnp.where(pred, 0, 1), [true_fn, false_fn], state)
