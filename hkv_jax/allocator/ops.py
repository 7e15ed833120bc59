"""The allocator's operations as pure functions ``state -> (state, result)``; jit them with ``layout`` static.

``schedule`` is vLLM's ``get_computed_blocks`` (for a waiting request) plus
``allocate_slots`` and ``cache_blocks``: all or nothing across groups (a
refused call changes nothing, except the out-of-window blocks a running
request releases first, as ``SEMANTICS.md`` says). Groups are unrolled in
Python (their rules are static); blocks and tables are arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkv_jax.allocator import block_pool as BP
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


def _replace(state: AllocatorState, **kw) -> AllocatorState:
    return AllocatorState(**{**{f: getattr(state, f) for f in state.__dataclass_fields__}, **kw})


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


def _remove_skipped(layout: Layout, state: AllocatorState, slot, g: int, computed) -> AllocatorState:
    """Release the blocks group ``g`` no longer needs after ``computed`` tokens (replaced by the null block)."""
    spec, bs = layout.groups[g].spec, layout.block_size
    row, L = state.tables[slot, g], state.table_len[slot, g]
    idx = jnp.arange(row.shape[0])
    skip = skipped_tokens(spec, computed)
    sb = jnp.where(skip > 0, jnp.minimum(skip // bs, L), 0)
    if layout.is_mamba(g):
        first = state.retired[slot, g]
        bp = BP.free_blocks(state.bp, _reversed_range(row, first, sb))
        row = jnp.where((idx >= first) & (idx < sb), 0, row)
        retired = jnp.where(first < sb, sb, first)
        ls = state.last_state[slot, g]
        drop = (ls >= 0) & (ls < _cdiv(computed, bs) - 1) & (row[jnp.maximum(ls, 0)] != 0)
        bp = BP.free_blocks(bp, jnp.where(drop, row[jnp.maximum(ls, 0)], 0)[None])
        row = jnp.where(drop & (idx == ls), 0, row)
        return _set_row(_replace(state, bp=bp), slot, g, row, retired=retired)
    # Walk back from the last skipped entry, stopping at the first null one (released earlier).
    last_null = jnp.max(jnp.where((idx < sb) & (row == 0), idx, -1))
    bp = BP.free_blocks(state.bp, _reversed_range(row, last_null + 1, sb))
    row = jnp.where((idx > last_null) & (idx < sb), 0, row)
    return _set_row(_replace(state, bp=bp), slot, g, row)


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
    hit_blocks, h, boundary = lookup(layout, state, slot)
    h = jnp.where(waiting, h, 0)
    hit_blocks = jnp.where(waiting, hit_blocks, 0)
    boundary = jnp.where(waiting, boundary, 0)
    H = hit_blocks.shape[1]
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
                bp, ids = BP.get_new_blocks(st.bp, jnp.where(grow, 1, 0), 1)
                row = jnp.where(grow & (idx == required - 1), ids[0], row)
                ls = jnp.where(grow & (L > 0), L - 1, st.last_state[slot, g])
                st = _set_row(_replace(st, bp=bp), slot, g, row, jnp.where(grow, required, L), last_state=ls)
            else:
                cnt = jnp.maximum(_cdiv(need, bs) - L, 0)
                bp, ids = BP.get_new_blocks(st.bp, cnt, M)
                pos = jnp.where(idx < cnt, L + idx, M)
                row = jnp.append(row, 0).at[pos].set(ids)[:M]
                st = _set_row(_replace(st, bp=bp), slot, g, row, L + cnt)
        # Enter every newly filled block in the prefix cache (dense retention).
        nfull = jnp.minimum(jnp.minimum(computed + n, T), (T // bs) * bs) // bs
        hashes = jnp.pad(st.hashes[slot], ((0, M - H), (0, 0)))
        for g in range(G):
            row, before = st.tables[slot, g], st.num_cached[slot, g]
            new = jnp.where((idx >= before) & (idx < nfull), row, 0)
            bp = BP.cache_blocks(st.bp, new, hashes, jnp.int32(g))
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
