"""The allocator's operations as pure functions ``state -> (state, result)``; jit them with ``layout`` static.

``schedule`` is vLLM's ``get_computed_blocks`` (for a waiting request) plus
``allocate_slots`` and ``cache_blocks``: all or nothing across groups (a
refused call changes nothing, except the out-of-window blocks a running
request releases first, as ``SEMANTICS.md`` says). Groups are unrolled in
Python (their rules are static); blocks and tables are arrays.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkv_jax.allocator import block_pool as BP
from hkv_jax.allocator import pool as P
from hkv_jax.allocator.hashing import SEED, block_hashes, hash_one_block
from hkv_jax.allocator.managers import lookup, skipped_tokens
from hkv_jax.allocator.state import EMPTY, RUNNING, WAITING, AllocatorState, Layout

_NO_EXTRA = jnp.zeros(0, jnp.uint32)


def _cdiv(a, b: int):
    return (a + b - 1) // b


def _set_row(state: AllocatorState, slot, g: int, row, length=None, **rg) -> AllocatorState:
    """Replace request ``slot``'s table of group ``g`` (and per-(request, group) scalars)."""
    upd = {"tables": state.tables.at[slot, g].set(row)}
    if length is not None:
        upd["table_len"] = state.table_len.at[slot, g].set(length)
    for name, value in rg.items():
        upd[name] = getattr(state, name).at[slot, g].set(value)
    return _replace(state, **upd)


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
    state = _clear_tables(state, slot)
    return _replace(
        state,
        status=state.status.at[slot].set(WAITING),
        tokens=state.tokens.at[slot].set(tokens),
        num_tokens=state.num_tokens.at[slot].set(num_tokens),
        salt=state.salt.at[slot].set(salt),
        hashes=state.hashes.at[slot].set(hashes),
        num_computed=state.num_computed.at[slot].set(0),
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
    return _replace(state, tokens=tokens, num_tokens=state.num_tokens.at[slot].set(n1), hashes=hashes)


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
    bp = BP.free_blocks(BP.free_blocks(state.bp, released[0]), released[1])
    return _set_row(_replace(state, bp=bp), slot, g, row, retired=retired)


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
    remaining = T - C - h
    n = jnp.where(num_tokens < 0, remaining, jnp.minimum(num_tokens, remaining))
    computed = jnp.minimum(C + h, layout.max_model_len)
    main = computed + n
    need = jnp.minimum(main, layout.max_model_len)
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
            key_slot = st.bp.cache.block_slot[last]
            impossible |= waiting & (nhit > 0) & (key_slot >= 0) & st.step_cached[jnp.maximum(key_slot, 0)]
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
        nfull = jnp.minimum(jnp.minimum(computed + n, T), (T // bs) * bs) // bs
        hashes = jnp.pad(st.hashes[slot], ((0, M - H), (0, 0)))
        for g in range(G):
            row, before = st.tables[slot, g], st.num_cached[slot, g]
            new = jnp.where((idx >= before) & (idx < nfull), row, 0)
            bp = BP.cache_blocks(st.bp, row, hashes, jnp.int32(g), before, jnp.maximum(before, nfull))
            step_cached = st.step_cached
            if layout.is_mamba(g):
                key_slots = bp.cache.block_slot[new]
                step_cached = step_cached.at[jnp.where(new > 0, key_slots, step_cached.shape[0])].set(True, mode="drop")
            st = _replace(st, bp=bp, step_cached=step_cached,
                          num_cached=st.num_cached.at[slot, g].set(jnp.maximum(before, nfull)))
        st = _replace(st, status=st.status.at[slot].set(RUNNING), num_computed=st.num_computed.at[slot].set(C + h + n))
        return st, first_new

    st, first_new = jax.lax.cond(ok, commit, lambda s: (s, s.table_len[slot]), st)
    return st, ScheduleResult(ok, n, h, boundary, hit_blocks, first_new)


def _pop(bp: BP.BlockPoolState, count, max_count: int):
    """``get_new_blocks``, skipped when nothing is wanted."""
    return jax.lax.cond(count > 0, lambda: BP.get_new_blocks(bp, count, max_count),
                        lambda: (bp, jnp.zeros(max_count, jnp.int32)))


def _clear_tables(state: AllocatorState, slot) -> AllocatorState:
    return _replace(
        state,
        tables=state.tables.at[slot].set(0),
        table_len=state.table_len.at[slot].set(0),
        num_cached=state.num_cached.at[slot].set(0),
        last_state=state.last_state.at[slot].set(-1),
        retired=state.retired.at[slot].set(0),
    )


def _release(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Free every block of ``slot``: group by group, each table last entry first (leading nulls skipped)."""
    bp = state.bp
    M = layout.max_blocks
    idx = jnp.arange(M)
    for g in range(layout.num_groups):
        row, L = state.tables[slot, g], state.table_len[slot, g]
        first = jnp.min(jnp.where((idx < L) & (row != 0), idx, M))
        bp = BP.free_blocks(bp, _reversed_range(row, first, L))
    return _clear_tables(_replace(state, bp=bp), slot)


def free(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a request's blocks and empty its slot."""
    st = _release(layout, state, slot)
    return _replace(st, status=st.status.at[slot].set(EMPTY), num_tokens=st.num_tokens.at[slot].set(0),
                    num_computed=st.num_computed.at[slot].set(0))


def preempt(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a running request's blocks; it waits again with its tokens kept."""
    st = _release(layout, state, slot)
    return _replace(st, status=st.status.at[slot].set(WAITING), num_computed=st.num_computed.at[slot].set(0))


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
        status=state.status.at[dst].set(jnp.where(nfull > 0, RUNNING, WAITING)),
        tokens=copy(state.tokens), num_tokens=copy(state.num_tokens), salt=copy(state.salt),
        hashes=copy(state.hashes),
        num_computed=state.num_computed.at[dst].set(nfull * layout.block_size),
        tables=state.tables.at[dst].set(rows),
        table_len=state.table_len.at[dst].set(jnp.full((layout.num_groups,), nfull)),
        num_cached=state.num_cached.at[dst].set(jnp.minimum(state.num_cached[src], nfull)),
    )


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


def append_batch(layout: Layout, state: AllocatorState, slots, tokens) -> AllocatorState:
    """``append_token`` for each (slot, token), in order."""
    def body(st, x):
        return append_token(layout, st, x[0], x[1]), None

    return jax.lax.scan(body, state, (slots, tokens))[0]


def decode_step(layout: Layout, state: AllocatorState, slots):
    """Every request in ``slots`` (distinct, running) allocates slots for one more token: one vectorised program.

    Same state and results as ``schedule_batch(slots, 1)``, computed for all requests at once: the
    out-of-window releases of every (request, group) in call order, one pop from the queue head for
    all new blocks, then the cache inserts. That order equals vLLM's request-by-request order when
    the new blocks come from blocks already free before the step and no released block goes to the
    queue front; otherwise (a nearly full pool, uncached releases) it falls back to
    ``schedule_batch``. Returns (state, ok ``bool[B]``, whether the vectorised path ran).
    """
    bs, G, M, N = layout.block_size, layout.num_groups, layout.max_blocks, layout.num_blocks
    B = slots.shape[0]
    C, T = state.num_computed[slots], state.num_tokens[slots]
    computed = jnp.minimum(C, layout.max_model_len)
    main = computed + 1
    need = jnp.minimum(main, layout.max_model_len)
    rows, lens = state.tables[slots], state.table_len[slots]
    retired, last_state = state.retired[slots], state.last_state[slots]
    out = [jax.vmap(lambda r, l, rt, ls, c, g=g: _skip_row(layout, g, r, l, rt, ls, c))(
        rows[:, g], lens[:, g], retired[:, g], last_state[:, g], computed) for g in range(G)]
    rows = jnp.stack([o[0] for o in out], 1)
    retired = jnp.stack([o[1] for o in out], 1)
    released = jnp.stack([o[3] for o in out], 1).reshape(B * G * 2, M)  # free calls in vLLM's order

    cnt = []
    for g in range(G):
        if layout.is_mamba(g):
            cnt.append((_cdiv(main, bs) > lens[:, g]).astype(jnp.int32))
        else:
            cnt.append(jnp.maximum(_cdiv(need, bs) - lens[:, g], 0))
    cnt = jnp.stack(cnt, 1)  # [B, G], each 0 or 1
    total = jnp.sum(cnt)

    pool, cache = state.bp.pool, state.bp.cache
    flat = released.reshape(-1)
    valid = flat > 0
    fb = jnp.where(valid, flat, 0)
    ref = pool.ref_count.at[jnp.where(valid, flat, N)].add(-1, mode="drop")
    posn = jnp.arange(flat.shape[0])
    last_occ = jnp.full(N, -1, jnp.int32).at[jnp.where(valid, flat, N)].max(posn, mode="drop")
    now_free = valid & (ref[fb] == 0) & (last_occ[fb] == posn)
    cached = cache.block_slot[fb] >= 0
    to_front, to_back = now_free & ~cached, now_free & cached
    nfull = jnp.minimum(jnp.minimum(C + 1, T), (T // bs) * bs) // bs
    before = state.num_cached[slots]
    fast = (
        jnp.all(state.status[slots] == RUNNING) & jnp.all(T - C >= 1)
        & (total <= pool.num_free) & ((total == 0) | ~jnp.any(to_front))
        & jnp.all(nfull[:, None] - before <= 1)
    )

    def vectorised(state: AllocatorState):
        n_front, n_back = jnp.sum(to_front, dtype=jnp.int32), jnp.sum(to_back, dtype=jnp.int32)
        p = jax.lax.cond(pool.tail - pool.head + n_front + n_back > N, P.compact, lambda q: q,
                         replace(pool, ref_count=ref))
        # Front: later calls go in front of earlier ones, each call in its own order.
        front_rank = (jnp.cumsum(to_front.reshape(-1, M)[::-1].reshape(-1), dtype=jnp.int32) - 1
                      ).reshape(-1, M)[::-1].reshape(-1)
        new_pos = jnp.where(to_front, p.head - n_front + front_rank, p.tail + jnp.cumsum(to_back, dtype=jnp.int32) - 1)
        p = replace(p, queue=p.queue.at[jnp.where(now_free, new_pos % N, N)].set(flat, mode="drop"),
                          pos=p.pos.at[jnp.where(now_free, flat, N)].set(new_pos, mode="drop"),
                          head=p.head - n_front, tail=p.tail + n_back, num_free=p.num_free + n_front + n_back)
        bp = BP.BlockPoolState(pool=p, cache=cache)
        bp, ids = _pop(bp, total, B * G)
        offset = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(B, G)
        new_block = jnp.where(cnt > 0, ids[offset], 0)
        idx = jnp.arange(M)
        new_rows, new_lens, new_last = [], [], []
        for g in range(G):
            r, L, nb = rows[:, g], lens[:, g], new_block[:, g]
            if layout.is_mamba(g):
                required = _cdiv(main, bs)
                grow = cnt[:, g] > 0
                r = jnp.where(grow[:, None] & (idx[None, :] == (required - 1)[:, None]), nb[:, None], r)
                new_last.append(jnp.where(grow & (L > 0), L - 1, last_state[:, g]))
                new_lens.append(jnp.where(grow, required, L))
            else:
                r = jnp.where((cnt[:, g] > 0)[:, None] & (idx[None, :] == L[:, None]), nb[:, None], r)
                new_last.append(last_state[:, g])
                new_lens.append(L + cnt[:, g])
            new_rows.append(r)
        rows3, lens3, last3 = jnp.stack(new_rows, 1), jnp.stack(new_lens, 1), jnp.stack(new_last, 1)
        # Cache the blocks this token filled: at most one per (request, group), in request then group order.
        pos_c = jnp.minimum(before, M - 1)
        blk = jnp.take_along_axis(rows3, pos_c[:, :, None], axis=2)[:, :, 0]
        todo = (nfull[:, None] > before) & (blk > 0)
        keys = state.hashes[slots[:, None], jnp.minimum(pos_c, state.hashes.shape[1] - 1)]  # [B, G, 4]
        order = jnp.nonzero(todo.reshape(-1), size=B * G, fill_value=0)[0]
        mamba_g = jnp.array([layout.is_mamba(g) for g in range(G)])

        def insert(i, carry):
            c, step_cached = carry
            k = order[i]
            b, g = k // G, k % G
            c = BP.pc.insert(BP.pc.evict(c, blk[b, g]), blk[b, g], keys[b, g], g.astype(jnp.int32))
            ks = c.block_slot[blk[b, g]]
            step_cached = step_cached.at[jnp.where(mamba_g[g], ks, step_cached.shape[0])].set(True, mode="drop")
            return c, step_cached

        c, step_cached = jax.lax.fori_loop(0, jnp.sum(todo), insert, (bp.cache, state.step_cached))
        st = _replace(
            state,
            bp=BP.BlockPoolState(pool=bp.pool, cache=c),
            step_cached=step_cached,
            tables=state.tables.at[slots].set(rows3),
            table_len=state.table_len.at[slots].set(lens3),
            retired=state.retired.at[slots].set(retired),
            last_state=state.last_state.at[slots].set(last3),
            num_cached=state.num_cached.at[slots].set(jnp.maximum(before, nfull[:, None])),
            num_computed=state.num_computed.at[slots].set(C + 1),
        )
        return st, jnp.ones(B, bool)

    def sequential(state: AllocatorState):
        st, ok, _, _ = schedule_batch(layout, state, slots, jnp.ones(B, jnp.int32))
        return st, ok

    state, ok = jax.lax.cond(fast, vectorised, sequential, state)
    return state, ok, fast

