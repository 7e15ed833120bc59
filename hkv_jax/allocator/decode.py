"""Batched decode: every running request of a batch allocates slots for one more token, in one program."""

from __future__ import annotations

import enum
import functools
from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkv_jax.allocator import block_pool, free_queue, prefix_cache
from hkv_jax.allocator.coordinator import cacheable_tokens, schedule_batch
from hkv_jax.allocator.managers import allocation, release_row, skipped_tokens
from hkv_jax.allocator.state import RUNNING, AllocatorState, Layout, cond_mutable, counter, set_counters, switch_mutable


class DecodePath(enum.IntEnum):
    """Which path ``decode_step`` took (its third result, ``i32[]``)."""

    COUNTED = 0        # no block moved: it only counted the token
    VECTORISED = 1     # blocks moved, all lanes at once
    MANY_RELEASES = 2  # vectorised, with free calls that release several blocks each
    FALLBACK = 3       # the sequential ``schedule_batch`` (or, with ``fallback=False``, nothing applied)


class _DecodePlan(NamedTuple):
    """What a busy decode step does (``decode_step``), planned read-only."""

    branch: jax.Array     # i32[]: a ``DecodePath`` other than COUNTED
    releases: free_queue.Release   # the free calls (one block each), less the blocks taken again in the step
    pop: free_queue.PopPlan        # ``total`` blocks from the queue as it was ...
    old_count: jax.Array  # i32[]: ... of which the step takes these (the others come from its releases)
    new_block: jax.Array  # i32[B, G]: the new block of each (request, group), 0 = none
    blk: jax.Array        # i32[B, U, G]: the blocks this token lets enter the prefix cache, by hash row ...
    todo: jax.Array       # bool[B, U, G]: ... where one does
    keys: jax.Array       # u32[B, U, 4]: the hash of each row


class _DecodeInputs(NamedTuple):
    """What ``_decode`` reads before it knows whether the step is idle (shapes: ``AllocatorState``)."""

    counts: jax.Array
    tables: jax.Array | None  # None where no group releases blocks as tokens come (nothing to read)


def decode_step(layout: Layout, state: AllocatorState, slots, fallback: bool = True, mask=None, lookahead=None):
    """Every request in ``slots`` (distinct, running) allocates slots for one more token: one vectorised program.

    ``mask: bool[B]`` (optional): the lanes that take part; the others change nothing and report
    ``ok`` False. Same state and results as ``schedule_batch(slots, 1)``, computed for all requests
    at once with updates proportional to the blocks that move, not to the pool or the tables. A step
    where no block moves (no request needs a block, fills one or releases one: most steps) only
    counts the token. Otherwise: the out-of-window releases of every (request, group) in call order,
    the new blocks (each request's from the blocks it and earlier requests released to the front,
    then from the queue head: ``pool.pops_after_releases``), then the cache inserts: vLLM's
    request-by-request order. Where that needs more (a nearly full pool, a queue to compact, an
    evicted key with duplicates) it falls back to ``schedule_batch``. A busy step plans everything
    read-only first, so its branch updates the state in place.
    Returns (state, ok ``bool[B]``, the path taken: ``DecodePath`` as ``i32[]``).

    ``fallback`` (static) False leaves the fallback out of the program: ``DecodePath.FALLBACK`` then applies nothing
    (the state comes back unchanged, ``ok`` all False) and the caller runs ``schedule_batch(layout,
    state, slots, 1)`` itself. The program is much smaller, and on CPU a call's fixed cost grows with
    the program even where a branch never runs. A host loop on CPU does better still with
    ``idle_decode`` first (see there).

    ``lookahead: i32[B]`` (optional): each lane also holds slots for that many draft tokens after its
    token (``schedule``'s ``lookahead``); a lane that needs two new blocks of a group for them takes the
    sequential path.
    """
    if mask is None:
        mask = jnp.ones(slots.shape, bool)
    return _decode(layout, state, slots, mask, fallback, count_only=False, lookahead=lookahead)


def count_if_idle(layout: Layout, state: AllocatorState, slots, mask) -> tuple[AllocatorState, jax.Array]:
    """``decode_step``'s idle path alone, for use inside a program: where every lane of ``mask`` only
    counts its token, the state after doing so, else ``state`` itself; and per lane whether it only
    counts its token (``bool[B]``, False outside ``mask``). No conditional: a cheap program for steps
    the caller expects to be idle (the engine's decode steps when the previous step said so)."""
    counts, lane_idle = _decode(layout, _DecodeInputs(state.counts, state.tables), slots, mask, False,
                                count_only=True)
    return replace(state, counts=counts), lane_idle


def idle_decode(layout: Layout, state: AllocatorState, slots) -> tuple[AllocatorState, jax.Array]:
    """Whether ``decode_step(layout, state, slots)`` would only count the token (``DecodePath.COUNTED``, the usual
    step), and the state it would leave then (else ``state`` itself).

    A host loop calls this first and, when the step is idle, takes the returned state; otherwise it
    calls ``decode_step``. It is jitted already (call it as it is: wrapping it in ``jax.jit`` again
    would pass the whole state in). Its program takes only the counters (and the block tables where a
    window group may release a block), returns the new counters and donates nothing: on CPU a call's
    fixed cost grows with every array passed in and out (figures: ``benchmarks/README.md``).
    Returns ``(state, idle bool[])``. Inside one jitted serving step use ``decode_step``.
    """
    tables = state.tables if _release_groups(layout) else None
    counts, idle = _idle_decode(layout, _DecodeInputs(state.counts, tables), slots)
    return replace(state, counts=counts), idle


def _release_groups(layout: Layout) -> list[int]:
    """The groups that may release blocks in a decode step (out of the window or chunk; Mamba states)."""
    return [g for g in range(layout.num_groups) if not layout.groups[g].spec.keeps_every_token]


@functools.partial(jax.jit, static_argnums=0)
def _idle_decode(layout: Layout, inputs: _DecodeInputs, slots):
    counts, lane_idle = _decode(layout, inputs, slots, jnp.ones(slots.shape, bool), False, count_only=True)
    return counts, jnp.all(lane_idle)


def _plan_releases(cache, pool: free_queue.FreeBlockQueue, calls: jax.Array, early: jax.Array) -> free_queue.Release:
    """The free calls ``calls: i32[K, W]`` of a step (request, group, call order), ``early: bool[K, W]``
    those released as they leave a window (window-aware eviction)."""
    return free_queue.plan_free(pool, calls, block_pool.to_back(cache, calls, early))


def _decode(layout: Layout, state: AllocatorState | _DecodeInputs, slots, mask, fallback: bool, count_only: bool,
            lookahead=None):
    """``decode_step``'s body; ``count_only``: its idle path alone (the new counts, and per lane whether
    it only counts its token), computed before anything busy (from the ``_DecodeInputs`` only)."""
    G, M, R = layout.num_groups, layout.max_blocks, layout.max_requests
    B = slots.shape[0]
    at = jnp.where(mask, slots, R)                                           # masked lanes write nothing
    rows = state.counts[slots]                                               # [B, 3 + 4G]: one gather
    C, T = counter(rows, "num_computed"), counter(rows, "num_tokens")
    computed = jnp.minimum(C, layout.max_model_len)
    main = computed + 1
    need = jnp.minimum(main + (0 if lookahead is None else lookahead), layout.max_model_len)
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
        r, rt, rel = jax.vmap(lambda *a: release_row(layout, g, *a))(
            tables[slots, g], lens[:, g], retired[:, g], last_state[:, g], computed)
        return r, rt, jnp.where(mask[:, None, None], rel, 0)

    for g in range(G):
        if g not in release_groups:
            retired_new.append(retired[:, g])
        elif layout.is_mamba(g):
            r, rt, rel = wide_releases(state.tables, g)
            retired_new.append(rt)
            after[g] = r
            single &= jnp.all(jnp.sum(rel > 0, axis=-1) <= 1)
            calls.append(jnp.max(rel, axis=-1))                              # [B, 2]: one id per free call
            changed = (r != state.tables[slots, g]) & mask[:, None]          # at most 2 entries per row if single
            for j in (jnp.argmax(changed, axis=-1), M - 1 - jnp.argmax(changed[:, ::-1], axis=-1)):
                zeroed.append((g, j, jnp.any(changed, axis=-1)))
        else:
            skip = skipped_tokens(layout.groups[g].spec, computed)
            sb = jnp.where(skip > 0, jnp.minimum(skip // layout.block_sizes[g], lens[:, g]), 0)
            last, below = (state.tables[slots, g, jnp.maximum(sb - k, 0)] for k in (1, 2))
            freed = mask & (sb > 0) & (last != 0)
            single &= jnp.all(~freed | (sb < 2) | (below == 0))
            retired_new.append(retired[:, g])
            cleared[g] = sb
            calls.append(jnp.stack([jnp.where(freed, last, 0), jnp.zeros_like(last)], 1))
            zeroed.append((g, sb - 1, freed))
    flat = jnp.stack(calls, 1).reshape(-1) if calls else jnp.zeros(0, jnp.int32)  # request, group, call order
    early_g = jnp.array([layout.evicts_early(g) for g in release_groups], bool)
    early = jnp.broadcast_to(early_g[None, :, None], (B, len(release_groups), 2)).reshape(-1)
    retired_new = jnp.stack(retired_new, 1)

    cnt, new_idx, lens_new, last_new = (jnp.stack(x, 1) for x in zip(*(
        allocation(layout, g, lens[:, g], main, need, last_state[:, g]) for g in range(G))))
    cnt = jnp.where(mask[:, None], cnt, 0)                                   # [B, G], 0 or 1 but for lookahead
    total = jnp.sum(cnt)
    before = counter(rows, "num_cached")                                     # [B, G]
    cached = cacheable_tokens(layout, jnp.minimum(C + 1, T))
    nfull = cached[:, None] // jnp.array(layout.block_sizes, jnp.int32)      # [B, G]
    nfull = jnp.where(mask[:, None], nfull, before)                          # masked lanes cache nothing
    num_cached = jnp.maximum(before, nfull)
    running = (counter(rows, "status") == RUNNING) & (T - C >= 1)
    releases = jnp.any(jnp.stack(calls, 1) > 0, axis=(1, 2)) if calls else jnp.zeros(B, bool)
    # Per request: it only counts the token (no block taken, filled or released).
    lane_idle = (running & (jnp.sum(cnt, axis=1) == 0) & jnp.all(num_cached == before, axis=1) & ~releases
                 & jnp.all(retired_new == retired, axis=1))
    idle = jnp.all(lane_idle | ~mask)
    if count_only:
        return set_counters(state.counts, at, num_computed=jnp.where(idle, C + 1, C)), lane_idle & mask

    def entry(tables, g, j):
        """Entry ``j`` of group ``g``'s row after the releases."""
        j = jnp.clip(j, 0, M - 1)
        if g in cleared:
            return jnp.where(j < cleared[g], 0, tables[slots, g, j])
        return after[g][bidx, j] if g in after else tables[slots, g, j]

    def wide_calls(tables):
        """Every release group's rows after the step, and all free calls ``[B * calls, M]`` (request, group,
        call order) with which go to the front early (built only in a busy step). A window group's second
        call is always empty (only a Mamba group frees a previous state), so it is left out: the first step
        after long prefills frees most of the pool, and every entry costs in each pass over the calls."""
        out = {g: wide_releases(tables, g) for g in release_groups}
        per_group = {g: rel if layout.is_mamba(g) else rel[:, :1] for g, (_, _, rel) in out.items()}
        wide = jnp.concatenate(list(per_group.values()), 1).reshape(-1, M)
        wide_early = jnp.concatenate([jnp.full(rel.shape[:2], layout.evicts_early(g)) for g, rel in per_group.items()],
                                     1).reshape(-1)
        return {g: o[0] for g, o in out.items()}, wide, jnp.broadcast_to(wide_early[:, None], wide.shape)

    # The blocks a step caches: hash units ``U`` per scheduling unit; row ``r`` of a request is the hash
    # ``hu - U + r`` (``hu``: hash units after the step). It keys group ``g``'s block ending there, if one
    # does ((r + 1) % k == 0, k: the group's hash units per block; static, as ``hu`` is a multiple of U),
    # at table index ``nfull - segment + (r + 1) // k - 1``; reachable or not is static too.
    U = layout.scheduler_block_size // layout.hash_block_size
    segments = jnp.array([layout.scheduler_block_size // bs for bs in layout.block_sizes], jnp.int32)
    row_block = [[(r + 1) // layout.hashes_per_block(g) - 1 if (r + 1) % layout.hashes_per_block(g) == 0 else None
                  for g in range(G)] for r in range(U)]

    def cache_rows(nfull):
        """Per hash row, per group: the table index ``i32[B]`` of the block it keys (clipped where none)."""
        return [[jnp.maximum(nfull[:, g] - segments[g] + (0 if i is None else i), 0) for g, i in enumerate(row)]
                for row in row_block]

    def to_cache(nfull):
        """``bool[B, U, G]``: where a block enters the prefix cache (between ``before`` and ``nfull``,
        reachable, keyed by the row)."""
        out = []
        for r, row in enumerate(row_block):
            cols = []
            for g, i in enumerate(row):
                if i is None or not layout.reachable(g, layout.scheduler_block_size // layout.block_sizes[g])[i]:
                    cols.append(jnp.zeros(B, bool))
                    continue
                j = nfull[:, g] - segments[g] + i
                cols.append((j >= before[:, g]) & (j < nfull[:, g]) & (j >= 0))
            out.append(jnp.stack(cols, 1))
        return jnp.stack(out, 1)

    def busy_plan(
        state: AllocatorState, releases: free_queue.Release, pop: free_queue.PopPlan, keys
    ) -> tuple[_DecodePlan, jax.Array]:
        """The busy step's plan (``branch`` left 0) with the free calls ``releases`` made first, request by
        request: each request's new blocks come from the blocks it and earlier requests freed to the
        front, then from ``pop`` (the queue as it was: ``pops_after_releases``). Also whether evicting the
        new blocks' cache entries needs no promotion (a key with other blocks: the sequential schedule
        handles that)."""
        taken = free_queue.pops_after_releases(releases, jnp.sum(cnt, axis=1), G)
        i = jnp.cumsum(cnt, axis=1) - cnt                                    # the pop of (request, group)
        ids = jnp.take_along_axis(taken.ids, i, axis=1)
        old = pop.ids[jnp.clip(jnp.take_along_axis(taken.old_rank, i, axis=1), 0, B * G - 1)]
        new_block = jnp.where(cnt > 0, jnp.where(ids > 0, ids, old), 0)
        # The blocks that enter the prefix cache: those between ``before`` and ``nfull``, at most one
        # scheduling unit of each group, so keyed by the last U hashes (``cache_rows``).
        blk = jnp.stack([jnp.stack([
            jnp.where((cnt[:, g] > 0) & (new_idx[:, g] == i), new_block[:, g], entry(state.tables, g, i))
            for g, i in enumerate(at_row)], 1) for at_row in cache_rows(nfull)], 1)       # [B, U, G]
        plan = _DecodePlan(jnp.int32(0), taken.release, pop, taken.old_count, new_block, blk,
                           to_cache(nfull) & (blk > 0), keys)
        return plan, ~jnp.any(prefix_cache.needs_promotion(state.block_pool.prefix_cache, new_block.reshape(-1)))

    def make_plan(state: AllocatorState) -> _DecodePlan:
        pool, cache = state.block_pool.free_queue, state.block_pool.prefix_cache
        releases = _plan_releases(cache, pool, flat[:, None], early[:, None])
        pop = free_queue.pop_plan(pool, total, B * G)  # enough blocks free before the step, whatever the releases give
        vectorisable = (jnp.all(running | ~mask) & (total <= pool.num_free) & pop.enough
                        & jnp.all(nfull - before <= segments) & jnp.all(cnt <= 1))
        # Vectorised, the blocks cached lie in the last scheduling unit: keyed by its U hashes.
        hu = cached // layout.hash_block_size
        keys = state.hashes[slots[:, None], jnp.clip(hu[:, None] - U + jnp.arange(U)[None, :], 0,
                                                     state.hashes.shape[1] - 1)]  # [B, U, 4]
        plan, alone = busy_plan(state, releases, pop, keys)
        fast = vectorisable & single & releases.fits & alone
        # Free calls releasing several blocks (the first step after a long prefill) are planned in their
        # own branch, which applies them only where they fit (else nothing: ``DecodePath.FALLBACK``).
        many = vectorisable & ~single & bool(release_groups)
        return plan._replace(
            branch=jnp.where(
                fast, DecodePath.VECTORISED, jnp.where(many, DecodePath.MANY_RELEASES, DecodePath.FALLBACK)
            ).astype(jnp.int32)
        )

    mamba_g = jnp.array([layout.is_mamba(g) for g in range(G)])

    def count_token(state: AllocatorState):
        return state.with_counters(at, num_computed=C + 1), (mask, jnp.int32(DecodePath.COUNTED))

    def unapplied(state: AllocatorState):
        return state, (jnp.zeros(B, bool), jnp.int32(DecodePath.FALLBACK))

    def vectorised(state: AllocatorState, plan: _DecodePlan, rows_after: dict | None):
        # The pops from the queue as it was first (the releases' front blocks go before the new head),
        # then the releases; every new block held once.
        p = free_queue.apply_free(
            free_queue.pop_apply(
                state.block_pool.free_queue, free_queue.pop_prefix(plan.pop, plan.old_count), hold=False
            ),
            plan.releases,
        )
        taken = plan.new_block.reshape(-1)
        p = replace(p, ref_count=p.ref_count.at[jnp.where(taken > 0, taken, p.num_blocks)].set(1, mode="drop"))
        c = prefix_cache.evict_alone(state.block_pool.prefix_cache, taken)
        todo, blk = plan.todo, plan.blk
        c = prefix_cache.insert_rows(c, jnp.where(todo, blk, 0).reshape(B * U, G), plan.keys.reshape(B * U, 4))
        marked = jnp.where(todo & mamba_g, blk, 0)
        step_cached = state.step_cached.at[layout.step_cached_index(c, marked)].set(True, mode="drop")
        # Table entries: the released ones become null, the new block goes in.
        tables = state.tables.at[at[:, None], jnp.arange(G)[None, :],
                                 jnp.where(cnt > 0, new_idx, M)].set(plan.new_block, mode="drop")
        if rows_after:  # released entries anywhere in the rows: write the release groups' rows whole
            for g, r in rows_after.items():
                keep = (idx_m[None, :] == jnp.where(cnt[:, g] > 0, new_idx[:, g], M)[:, None])
                tables = tables.at[at, g].set(jnp.where(keep, tables[slots, g], r), mode="drop")
        else:
            for g, j, ok in zeroed:
                tables = tables.at[at, g, jnp.where(ok, j, M)].set(0, mode="drop")
        st = replace(
            state,
            block_pool=block_pool.BlockPool(free_queue=p, prefix_cache=c),
            step_cached=step_cached,
            tables=tables,
        ).with_counters(at, table_len=lens_new, retired=retired_new, last_state=last_new, num_cached=num_cached,
                        num_computed=C + 1)
        return st, (mask, jnp.int32(DecodePath.MANY_RELEASES if rows_after else DecodePath.VECTORISED))

    def many_releases(state: AllocatorState, plan: _DecodePlan):
        """The free calls as they are (several blocks each), planned once: applied when they fit and the
        new blocks' cache entries need no promotion, else nothing is (``DecodePath.FALLBACK``)."""
        rows_after, wide, wide_early = wide_calls(state.tables)
        rel = _plan_releases(state.block_pool.prefix_cache, state.block_pool.free_queue, wide, wide_early)
        plan, alone = busy_plan(state, rel, plan.pop, plan.keys)
        plan, state = jax.lax.optimization_barrier((plan, state))  # reads before writes, as in ``busy``
        return cond_mutable(rel.fits & alone, lambda s: vectorised(s, plan, rows_after), unapplied, state)

    def sequential(state: AllocatorState):
        st, ok, _, _ = schedule_batch(layout, state, slots, jnp.ones(B, jnp.int32), mask, lookahead)
        return st, (ok, jnp.int32(DecodePath.FALLBACK))

    def busy(state: AllocatorState):
        """Plan (reads), then update in place: the barrier orders the reads before the writes,
        else XLA copies the pool and the cache in every branch."""
        plan = make_plan(state)
        plan, state = jax.lax.optimization_barrier((plan, state))
        fns = [lambda s: vectorised(s, plan, None), lambda s: many_releases(s, plan), unapplied]
        index = plan.branch - 1
        if not release_groups:  # the branch is never 2: no many-release branch to compile
            fns, index = [fns[0], fns[2]], jnp.minimum(index, 1)
        state, (ok, path) = switch_mutable(index, fns, state)
        if fallback:  # one copy of the sequential schedule, after the branch that found it needed
            state, (ok, path) = cond_mutable(path == DecodePath.FALLBACK, sequential, lambda s: (s, (ok, path)), state)
        return state, (ok, path)

    state, (ok, path) = switch_mutable(jnp.where(idle, 0, 1), [count_token, busy], state)
    return state, ok, path
