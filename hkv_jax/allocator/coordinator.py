"""vLLM's KV cache coordinator in jnp: one request's prefix lookup and allocation across every group.

``lookup`` intersects the groups' hits (the fixed point: iterate until every
type agrees, which works for any number of attention types). ``schedule`` is
vLLM's ``get_computed_blocks`` (for a waiting request) plus ``allocate_slots``
and ``cache_blocks``: all or nothing across groups (a refused call changes
nothing, except the out-of-window blocks a running request releases first, as
``docs/SEMANTICS.md`` says). Groups are visited in order by ``for_each_group``
(their rules are static, ``managers.py``; a run of groups with the same rules
is one loop); blocks and tables are arrays. ``schedule_batch`` runs it request
after request: the exact path every batched step is tested against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.allocator import block_pool, prefix_cache
from hkv_jax.allocator.managers import allocation, hit_blocks, release_row, skipped_tokens
from hkv_jax.allocator.requests import append_batch
from hkv_jax.allocator.state import RUNNING, WAITING, AllocatorState, Layout, for_each_group
from hkv_jax.planner import cdiv


def block_sizes(layout: Layout) -> jax.Array:
    """``i32[G]``: each group's block size."""
    return jnp.array(layout.block_sizes, jnp.int32)


def group_blocks(layout: Layout, per_hash: jax.Array) -> jax.Array:
    """``[..., G, H]`` values per group and block index from ``[..., G, H]`` values per group and hash
    index: block ``i`` of group ``g`` takes the value at the hash that keys it (``Layout.key_index``);
    0 past the group's last hashed block. The identity with one block size."""
    if layout.one_block_size:
        return per_hash
    H = per_hash.shape[-1]
    idx = np.stack([layout.key_index(g, H) for g in range(layout.num_groups)])        # [G, H]
    ok = np.stack([layout.key_valid(g, H) for g in range(layout.num_groups)])
    got = jnp.take_along_axis(per_hash, jnp.broadcast_to(jnp.asarray(idx), per_hash.shape), axis=-1)
    return jnp.where(ok, got, 0)


def group_hashes(layout: Layout, hashes: jax.Array, g: int, n: int) -> jax.Array:
    """``u32[..., n, 4]``: the hash that keys each of group ``g``'s first ``n`` blocks, from the request's
    hashes ``u32[..., H, 4]`` (zeros past its last hashed block). It depends on ``g``'s block size only."""
    got = hashes[..., jnp.asarray(layout.key_index(g, n)), :]
    return jnp.where(jnp.asarray(layout.key_valid(g, n))[:, None], got, 0)


def cacheable_tokens(layout: Layout, tokens):
    """Tokens whose blocks may enter the prefix cache: ``tokens`` cut to the scheduling unit (a block past
    the last multiple could not serve a hit yet)."""
    return tokens // layout.scheduler_block_size * layout.scheduler_block_size


def lookup(layout: Layout, state: AllocatorState, slot: jax.Array, key_slots: jax.Array | None = None,
           found: jax.Array | None = None):
    """Longest prefix-cache hit of the waiting request in ``slot``; ``key_slots: i32[G, H]``, optional:
    the cache entry ids of its keys (``prefix_cache.row_entries``), when the caller already looked them up;
    ``found: i32[G, H]``, optional: instead of them, a positive id per group and hash index where some
    cache holds the block (the host tier looks up device and host blocks together, ``host_tier.py``).

    Returns (hit blocks ``i32[G, H]`` (entries past the hit are 0), hit tokens,
    shared-prefix boundary: a longer prefix some group alone could serve, or 0).
    """
    G = layout.num_groups
    hashes = state.hashes[slot]  # u32[H, 4]
    H = hashes.shape[0]
    valid = jnp.arange(H) < state.num_tokens[slot] // layout.hash_block_size
    if found is None:
        if key_slots is None:  # one probe per hash: its slot holds every group's entry
            key_slots = prefix_cache.row_entries(
                state.block_pool.prefix_cache, prefix_cache.find_slots(state.block_pool.prefix_cache, hashes)
            ).T
        found = prefix_cache.block_at(state.block_pool.prefix_cache, key_slots)
    found = jnp.where(valid[None, :], found, 0)
    found = group_blocks(layout, found)  # [G, H]: by each group's block index
    sgs = [(layout.groups[sg[0]].spec, list(sg)) for sg in layout.spec_groups]
    all_found = [jnp.all(found[jnp.array(sg)] > 0, axis=0) for _, sg in sgs]

    blocks = jnp.zeros((G, H), jnp.int32)
    unit = layout.scheduler_block_size
    hit = state.num_tokens[slot] - 1
    cur = hit
    longest = jnp.int32(0)
    full_len = {}
    # First pass: every spec group computes its hit (full attention first).
    for k, (spec, sg) in enumerate(sgs):
        b, cur = hit_blocks(spec, layout.block_sizes[sg[0]], unit, found[jnp.array(sg)], all_found[k], cur)
        blocks = blocks.at[jnp.array(sg)].set(b)
        longest = jnp.maximum(longest, cur)
        if spec.keeps_every_token:
            full_len[k] = cur

    def one_pass(carry):
        hit, cur, longest, blocks = carry
        hit = cur
        for k, (spec, sg) in enumerate(sgs):
            if k in full_len:
                cur = jnp.minimum(cur, full_len[k])
                continue
            b, cur = hit_blocks(spec, layout.block_sizes[sg[0]], unit, found[jnp.array(sg)], all_found[k], cur)
            blocks = blocks.at[jnp.array(sg)].set(b)
            longest = jnp.maximum(longest, cur)
        return hit, cur, longest, blocks

    if not layout.simple_hybrid:
        # Repeat until no type shrinks the candidate (the fixed point); lengths only decrease.
        hit, cur, longest, blocks = jax.lax.while_loop(
            lambda c: c[1] < c[0], one_pass, (hit, cur, longest, blocks)
        )
    hit = cur
    blocks = jnp.where(jnp.arange(H)[None, :] < hit // block_sizes(layout)[:, None], blocks, 0)
    boundary = jnp.where(longest > hit, longest, 0)
    return blocks, hit, boundary


def token_counts(layout: Layout, C, T, h, num_tokens, lookahead=0):
    """Token arithmetic of a schedule (scalars or per request): ``C`` computed, ``T`` known, ``h`` hit
    tokens, ``num_tokens`` wanted (-1: all), ``lookahead`` slots for unverified (draft) tokens after
    them. Returns (new tokens ``n``, computed after the hit, tokens after the call, tokens to hold:
    lookahead included, tokens whose blocks are cached after the call: ``cacheable_tokens``, known
    tokens only)."""
    remaining = T - C - h
    n = jnp.where(num_tokens < 0, remaining, jnp.minimum(num_tokens, remaining))
    computed = jnp.minimum(C + h, layout.max_model_len)
    main = computed + n
    return (n, computed, main, jnp.minimum(main + lookahead, layout.max_model_len),
            cacheable_tokens(layout, jnp.minimum(main, T)))


def fit_width(x: jax.Array, width: int) -> jax.Array:
    """``x`` cut or zero-padded along its last axis to ``width`` (hit blocks by block index to table width:
    a group has at most ``width`` blocks, so a cut drops zeros only)."""
    n = x.shape[-1]
    if n >= width:
        return x[..., :width]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])


def cached_this_step(layout: Layout, state: AllocatorState, blocks: jax.Array) -> jax.Array:
    """Whether each of ``blocks`` is cached under an entry a Mamba group cached in this step (such a
    state cannot serve a hit before the next step)."""
    if not layout.mamba_groups:
        return jnp.zeros(blocks.shape, bool)
    at = layout.step_cached_index(state.block_pool.prefix_cache, blocks)
    return state.step_cached.at[at].get(mode="fill", fill_value=False)


def _set_row(state: AllocatorState, slot, g, row, length=None, **counters) -> AllocatorState:
    """Replace request ``slot``'s table of group ``g`` (an int or traced; and its group ``counters``)."""
    if length is not None:
        counters["table_len"] = length
    state = replace(state, tables=state.tables.at[slot, g].set(row))
    return state.with_counters(slot, g, **counters) if counters else state


def _remove_skipped(layout: Layout, state: AllocatorState, slot, rule: int, g, computed) -> AllocatorState:
    """Release the blocks group ``g`` (whose rules are group ``rule``'s: ``for_each_group``) no longer needs
    after ``computed`` tokens (replaced by the null block)."""
    row, retired, released = release_row(layout, rule, state.tables[slot, g], state.table_len[slot, g],
                                         state.retired[slot, g], state.last_state[slot, g], computed)
    bp = block_pool.free_blocks(
        block_pool.free_blocks(state.block_pool, released[0], front=layout.evicts_early(rule)), released[1]
    )
    return _set_row(replace(state, block_pool=bp), slot, g, row, retired=retired)


def _pop(bp: block_pool.BlockPool, count, max_count: int):
    """``get_new_blocks``, skipped when nothing is wanted."""
    return jax.lax.cond(count > 0, lambda: block_pool.get_new_blocks(bp, count, max_count),
                        lambda: (bp, jnp.zeros(max_count, jnp.int32)))


def _cache_filled(layout: Layout, st: AllocatorState, slot, cached) -> AllocatorState:
    """Enter every block of request ``slot`` that its first ``cached`` tokens (``cacheable_tokens``) fill and
    that is not cached yet in the prefix cache (dense retention)."""
    M, idx = layout.max_blocks, jnp.arange(layout.max_blocks)

    def one(rule, g, st):
        row, before, nfull = st.tables[slot, g], st.num_cached[slot, g], cached // layout.block_sizes[rule]
        row = jnp.where(layout.reachable(rule, M), row, 0)
        new = jnp.where((idx >= before) & (idx < nfull), row, 0)
        bp = block_pool.cache_blocks(st.block_pool, row, group_hashes(layout, st.hashes[slot], rule, M),
                                     jnp.asarray(g, jnp.int32), before, jnp.maximum(before, nfull))
        step_cached = st.step_cached
        if layout.is_mamba(rule):
            step_cached = step_cached.at[layout.step_cached_index(bp.prefix_cache, new)].set(True, mode="drop")
        return replace(st, block_pool=bp, step_cached=step_cached).with_counters(
            slot, g, num_cached=jnp.maximum(before, nfull))

    return for_each_group(layout, one, st)


def accept_drafts(layout: Layout, state: AllocatorState, slots, tokens, emitted, mask=None) -> AllocatorState:
    """After a speculative step (each lane scheduled one token with draft lookahead): append the first
    ``emitted[i]`` of ``tokens: i32[B, K]`` to the request in ``slots[i]`` (the accepted drafts, then the
    target's own token), count the accepted drafts, whose KV the step computed, as computed
    (``num_computed += emitted - 1``) and cache the blocks they fill, as a schedule of them would. Rejected
    drafts leave nothing: their slots stay held for the next step's lookahead, or are freed with the
    request."""
    if mask is None:
        mask = jnp.ones(slots.shape, bool)
    mask &= emitted > 0
    # One traced copy of ``append_batch`` (a few hundred operations with its hashing), not one per position.
    state = jax.lax.fori_loop(
        0, tokens.shape[1], lambda j, st: append_batch(layout, st, slots, tokens[:, j], mask & (j < emitted)), state)
    at = jnp.where(mask, slots, layout.max_requests)
    computed = state.num_computed[slots] + emitted - 1
    state = state.with_counters(at, num_computed=computed)
    # Blocks to cache only where drafts were accepted: visit those lanes alone.
    lanes = mask & (emitted > 1)
    order = jnp.nonzero(lanes, size=slots.shape[0], fill_value=0)[0]

    def cache(i, st):
        lane = order[i]
        known = jnp.minimum(computed[lane], st.num_tokens[slots[lane]])
        return _cache_filled(layout, st, slots[lane], cacheable_tokens(layout, known))

    return jax.lax.fori_loop(0, jnp.sum(lanes, dtype=jnp.int32), cache, state)


class ScheduleResult(NamedTuple):
    """What ``schedule`` reports (all arrays)."""

    ok: jax.Array  # bool[]
    num_new_tokens: jax.Array  # i32[]
    cache_hit_tokens: jax.Array  # i32[] (0 for a running request)
    shared_prefix_boundary: jax.Array  # i32[]
    hit_blocks: jax.Array  # i32[G, H]
    first_new: jax.Array  # i32[G]: table index of the first entry this call appended


def schedule(layout: Layout, state: AllocatorState, slot, num_tokens,
             lookahead=0) -> tuple[AllocatorState, ScheduleResult]:
    """Allocate slots for up to ``num_tokens`` (-1: all) more tokens of the request in ``slot``, and for
    ``lookahead`` draft tokens after them (speculative decoding: their slots are held, never cached, and
    ``num_computed`` does not count them; ``requests.accept_drafts`` books the verified ones)."""
    G, M = layout.num_groups, layout.max_blocks
    waiting = state.status[slot] == WAITING
    H = state.hashes.shape[1]
    no_hit = (jnp.zeros((G, H), jnp.int32), jnp.int32(0), jnp.int32(0))
    hits, h, boundary = jax.lax.cond(waiting, lambda: lookup(layout, state, slot), lambda: no_hit)
    hits_m = fit_width(hits, M)  # i32[G, M]
    C, T = state.num_computed[slot], state.num_tokens[slot]
    n, computed, main, need, cached = token_counts(layout, C, T, h, num_tokens, lookahead)
    idx = jnp.arange(M)

    st = for_each_group(layout, lambda rule, g, st: _remove_skipped(layout, st, slot, rule, g, computed), state)

    # Blocks the call takes from the free queue: new ones, and hit blocks that sit in the queue.
    ref = st.block_pool.free_queue.ref_count

    def count(rule, g, carry):
        total, impossible = carry
        L, bs = st.table_len[slot, g], layout.block_sizes[rule]
        nhit, hg = h // bs, hits_m[g]
        free_hit = (hg > 0) & (ref[hg] == 0) & (idx < nhit)
        if layout.is_mamba(rule):
            last = hg[jnp.maximum(nhit - 1, 0)]
            impossible |= waiting & (nhit > 0) & cached_this_step(layout, st, last)
            total += allocation(layout, rule, nhit + L, main, need, -1)[0] + jnp.sum(free_hit, dtype=jnp.int32)
        else:
            required = cdiv(need, bs)
            skipped = skipped_tokens(layout.groups[rule].spec, computed) // bs
            wait_cnt = jnp.maximum(required - jnp.maximum(skipped, nhit + L), 0) + jnp.sum(
                free_hit & (idx >= jnp.maximum(0, skipped - L)), dtype=jnp.int32)
            total += jnp.where(waiting, wait_cnt, jnp.maximum(required - L, 0))
        return total, impossible

    total, impossible = for_each_group(layout, count, (jnp.int32(0), jnp.bool_(False)))
    ok = ~impossible & (total <= st.block_pool.free_queue.num_free) & (n > 0)

    def take_hits(rule, g, st):
        nhit = h // layout.block_sizes[rule]
        skipped = skipped_tokens(layout.groups[rule].spec, computed) // layout.block_sizes[rule]
        row = jnp.where((idx >= skipped) & (idx < nhit), hits_m[g], 0)
        st = replace(st, block_pool=block_pool.touch(st.block_pool, jnp.where(waiting, row, 0)))
        return _set_row(st, slot, g, jnp.where(waiting, row, st.tables[slot, g]),
                        jnp.where(waiting, nhit, st.table_len[slot, g]),
                        num_cached=jnp.where(waiting, nhit, st.num_cached[slot, g]))

    def take_new(rule, g, st):
        row = st.tables[slot, g]
        cnt, first, length, last = allocation(layout, rule, st.table_len[slot, g], main, need,
                                              st.last_state[slot, g])
        bp, ids = _pop(st.block_pool, cnt, 1 if layout.is_mamba(rule) else M)
        row = row.at[jnp.where(idx < cnt, first + idx, M)].set(ids[jnp.minimum(idx, ids.shape[0] - 1)],
                                                               mode="drop")
        return _set_row(replace(st, block_pool=bp), slot, g, row, length, last_state=last)

    def commit(st: AllocatorState) -> tuple[AllocatorState, jax.Array]:
        st = for_each_group(layout, take_hits, st)
        first_new = st.table_len[slot]
        st = for_each_group(layout, take_new, st)
        st = _cache_filled(layout, st, slot, cached)
        st = st.with_counters(slot, status=RUNNING, num_computed=C + h + n)
        return st, first_new

    st, first_new = jax.lax.cond(ok, commit, lambda s: (s, s.table_len[slot]), st)
    return st, ScheduleResult(ok, n, h, boundary, hits, first_new)


def schedule_batch(layout: Layout, state: AllocatorState, slots, num_tokens, mask=None, lookahead=None):
    """``schedule`` for each request in order (one XLA program, same results as one call each).

    ``mask: bool[B]``, optional: only these lanes run (the others report nothing); the loop visits
    the active lanes only, so a mostly idle batch costs what its active lanes cost. ``lookahead:
    i32[B]``, optional: each lane's draft slots (``schedule``).
    Returns (state, ok ``bool[B]``, new tokens ``i32[B]``, cache-hit tokens ``i32[B]``).
    """
    B = slots.shape[0]
    if lookahead is None:
        lookahead = jnp.zeros(B, jnp.int32)
    if mask is None:
        def body(st, x):
            st, r = schedule(layout, st, *x)
            return st, (r.ok, r.num_new_tokens, r.cache_hit_tokens)

        state, (ok, n, h) = jax.lax.scan(body, state, (slots, num_tokens, lookahead))
        return state, ok, n, h
    lanes = jnp.nonzero(mask, size=B, fill_value=0)[0]

    def one(i, c):
        st, ok, n, h = c
        lane = lanes[i]
        st, r = schedule(layout, st, slots[lane], num_tokens[lane], lookahead[lane])
        return st, ok.at[lane].set(r.ok), n.at[lane].set(r.num_new_tokens), h.at[lane].set(r.cache_hit_tokens)

    zeros = jnp.zeros(B, jnp.int32)
    return jax.lax.fori_loop(0, jnp.sum(mask, dtype=jnp.int32), one, (state, jnp.zeros(B, bool), zeros, zeros))
