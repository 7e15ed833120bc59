"""A request's life in the allocator: admission, appended tokens, release, fork, and the step boundary.

Each operation exists one request at a time (the exact statement, which
``KVCacheManager`` and the trace replay call) and batched over many requests
in one vectorised update with the same result as the one-at-a-time calls in
order (``admit_batch``, ``append_batch``, ``release_batch``; what the serving
step calls). Slots of a batch are distinct.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.allocator import block_pool, free_queue, prefix_cache
from hkv_jax.allocator.hashing import SEED, block_hashes, hash_one_block
from hkv_jax.allocator.managers import eviction_order
from hkv_jax.allocator.state import EMPTY, RUNNING, WAITING, AllocatorState, Layout, for_each_group

# A numpy constant, not a device array: importing the package must not start a backend (that would have
# to wait for ``jax.distributed.initialize``).
_NO_EXTRA = np.zeros(0, np.uint32)
# Requests whose blocks one round of ``release_batch`` frees (a static width: a step releases few).
_RELEASE_ROUND = 16


def _clear_tables(state: AllocatorState, slots, **counters) -> AllocatorState:
    """Empty the tables of ``slots`` (a slot or ``i32[B]``; out-of-range ones are skipped) and set
    their request ``counters``."""
    return replace(state, tables=state.tables.at[slots].set(0, mode="drop")).with_counters(
        slots, table_len=0, num_cached=0, last_state=-1, retired=0, **counters)


def add_request(layout: Layout, state: AllocatorState, slot, tokens, num_tokens, salt) -> AllocatorState:
    """Put a waiting request in ``slot``: ``tokens`` ``i32[T]`` (first ``num_tokens`` valid), cache salt ``u32``."""
    valid = jnp.arange(layout.max_model_len) < num_tokens
    tokens = jnp.where(valid, tokens, 0)
    salt = jnp.asarray(salt, jnp.uint32).reshape(1)
    hashes = block_hashes(tokens, layout.hash_block_size, salt, _NO_EXTRA)
    state = _clear_tables(state, slot, status=WAITING, num_tokens=num_tokens, num_computed=0)
    return replace(
        state,
        tokens=state.tokens.at[slot].set(tokens),
        salt=state.salt.at[slot].set(salt),
        hashes=state.hashes.at[slot].set(hashes),
    )


def add_batch(layout: Layout, state: AllocatorState, slots, tokens, num_tokens, salts) -> AllocatorState:
    """``add_request`` for each row (``tokens`` ``i32[B, T]``), in order, in one program."""
    def body(st, x):
        return add_request(layout, st, *x), None

    return jax.lax.scan(body, state, (slots, tokens, num_tokens, salts))[0]


def admit_batch(layout: Layout, state: AllocatorState, slots, prompts, lens, salts) -> AllocatorState:
    """Admit ``A`` waiting requests whose prompts lie one after another in a flat buffer.

    ``slots: i32[A]`` (-1: no admission), ``prompts: i32[P]`` (admission ``a``'s prompt is the
    ``lens[a]`` tokens after the previous admissions'; the rest is padding), ``lens: i32[A]``,
    ``salts: u32[A]``. Only the prompts' tokens are written and only their full blocks hashed (a loop
    over the longest prompt's blocks, vectorised over the admissions), so the cost follows the
    prompts, not ``max_model_len``. Same allocator state as ``add_request`` per admission, except
    tokens and hashes past a request's ``num_tokens``, which nothing reads.
    """
    R, bs = layout.max_requests, layout.hash_block_size
    A, Pn = slots.shape[0], prompts.shape[0]
    lens = jnp.where(slots >= 0, lens, 0)
    at = jnp.where(slots >= 0, slots, R)                                   # dropped writes
    ends = jnp.cumsum(lens)
    starts = ends - lens
    p = jnp.arange(Pn)
    owner = jnp.minimum(jnp.searchsorted(ends, p, side="right"), A - 1)
    col = p - starts[owner]
    inside = (col >= 0) & (col < lens[owner])
    tokens = state.tokens.at[jnp.where(inside, at[owner], R), col].set(prompts, mode="drop")
    salt = salts.astype(jnp.uint32)[:, None]
    lane = jnp.arange(bs)

    def hash_block(i, carry):
        hashes, parent = carry
        blk = prompts[jnp.clip(starts[:, None] + i * bs + lane[None, :], 0, Pn - 1)]    # [A, bs]
        # Gathered once: fused into the hash, XLA would redo the gather for every use of a token.
        blk = jax.lax.optimization_barrier(blk)
        h = jax.vmap(hash_one_block, (0, 0, 0, None, None))(parent, blk, salt, i == 0, _NO_EXTRA)
        full = i < lens // bs
        return hashes.at[jnp.where(full, at, R), i].set(h, mode="drop"), jnp.where(full[:, None], h, parent)

    seed = jnp.broadcast_to(jnp.asarray(SEED), (A, 4))
    hashes, _ = jax.lax.fori_loop(0, jnp.max(lens) // bs, hash_block, (state.hashes, seed))
    state = replace(state, tokens=tokens, hashes=hashes, salt=state.salt.at[at].set(salt, mode="drop"))
    return _clear_tables(state, at, status=WAITING, num_tokens=lens, num_computed=0)


def append_token(layout: Layout, state: AllocatorState, slot, token) -> AllocatorState:
    """Append a sampled token; hash the block it fills, if it fills one."""
    return append_batch(layout, state, jnp.reshape(slot, (1,)), jnp.reshape(token, (1,)))


def append_batch(layout: Layout, state: AllocatorState, slots, tokens, mask=None) -> AllocatorState:
    """Append ``tokens[i]`` to the request in ``slots[i]`` (distinct) where ``mask`` (default: all);
    the blocks they fill are hashed, in one vectorised update."""
    bs, R = layout.hash_block_size, layout.max_requests
    if mask is None:
        mask = jnp.ones(slots.shape, bool)
    at = jnp.where(mask, slots, R)
    n = state.num_tokens[slots]
    toks = state.tokens.at[at, n].set(tokens, mode="drop")
    n1 = n + 1
    full = mask & (n1 % bs == 0)
    idx = jnp.maximum(n1 // bs - 1, 0)

    # Hashing costs a few hundred operations per block: only in steps where a block fills. Its gathers
    # run there too: XLA:CPU splits a gather from an array of a megabyte or more across threads however
    # few elements it takes, and run every step those two cost ~10 us each at 256 requests. A GPU keeps the
    # conditional too: XLA:GPU runs a block's hash as a kernel per few tokens (264 for Jamba's 256-token
    # hash blocks), more than the predicate's read to the host costs.
    def hash_filled():
        parent = jnp.where((idx > 0)[:, None], state.hashes[slots, jnp.maximum(idx - 1, 0)], jnp.asarray(SEED))
        blk = toks[slots[:, None], idx[:, None] * bs + jnp.arange(bs)[None, :]]           # [B, bs]
        return jax.vmap(hash_one_block, (0, 0, 0, 0, None))(parent, blk, state.salt[slots], idx == 0, _NO_EXTRA)

    h = jax.lax.cond(jnp.any(full), hash_filled, lambda: jnp.zeros((slots.shape[0], 4), jnp.uint32))
    hashes = state.hashes.at[jnp.where(full, slots, R), idx].set(h, mode="drop")
    return replace(state, tokens=toks, hashes=hashes).with_counters(at, num_tokens=n1)


def _release(layout: Layout, state: AllocatorState, slot, **counters) -> AllocatorState:
    """Free every block of ``slot``: group by group, each table last entry first (leading nulls skipped);
    its tables emptied and its request ``counters`` set."""
    M = layout.max_blocks
    idx = jnp.arange(M)

    def one(_, g, bp):
        row, L = state.tables[slot, g], state.table_len[slot, g]
        first = jnp.min(jnp.where((idx < L) & (row != 0), idx, M))
        return block_pool.free_blocks(bp, eviction_order(row, first, L))

    bp = for_each_group(layout, one, state.block_pool)
    return _clear_tables(replace(state, block_pool=bp), slot, **counters)


def free(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a request's blocks and empty its slot."""
    return _release(layout, state, slot, status=EMPTY, num_tokens=0, num_computed=0)


def preempt(layout: Layout, state: AllocatorState, slot) -> AllocatorState:
    """Release a running request's blocks; it waits again with its tokens kept."""
    return _release(layout, state, slot, status=WAITING, num_computed=0)


def release_batch(layout: Layout, state: AllocatorState, free: jax.Array, preempt: jax.Array) -> AllocatorState:
    """``free`` then ``preempt`` for every slot where ``free: bool[R]`` / ``preempt: bool[R]`` say so, in
    slot order, as batched free calls: one per (request, group), in rounds of a few requests (a step
    releases few), so the cost follows the released requests, not ``max_requests``."""
    R, G, M = layout.max_requests, layout.num_groups, layout.max_blocks
    go = free | preempt
    width = min(R, _RELEASE_ROUND)
    lanes = jnp.nonzero(go, size=R + width, fill_value=R)[0]                 # released slots, then R
    idx = jnp.arange(M)

    def round_(r, pool):
        slots = jax.lax.dynamic_slice(lanes, (r * width,), (width,))        # [W], R past the last
        rows = state.tables.at[slots].get(mode="fill", fill_value=0)        # [W, G, M]
        lengths = state.table_len.at[slots].get(mode="fill", fill_value=0)  # [W, G]
        first = jnp.min(jnp.where((idx < lengths[..., None]) & (rows != 0), idx, M), axis=-1)
        calls = jax.vmap(jax.vmap(eviction_order))(rows, first, lengths).reshape(width * G, M)
        cached = state.block_pool.prefix_cache.block_slot[calls] >= 0
        return free_queue.free_calls(pool, calls, cached)

    count = jnp.sum(go, dtype=jnp.int32)
    pool = jax.lax.fori_loop(0, (count + width - 1) // width, round_, state.block_pool.free_queue)
    at = jnp.where(go, jnp.arange(R), R)
    state = replace(state, block_pool=replace(state.block_pool, free_queue=pool))
    return _clear_tables(state, at, status=jnp.where(free, EMPTY, WAITING),
                         num_tokens=jnp.where(free, 0, state.num_tokens), num_computed=0)


def fork(layout: Layout, state: AllocatorState, src, dst) -> AllocatorState:
    """Start request ``dst`` as a copy of ``src`` (parallel sampling, beam search).

    The child shares ``src``'s full blocks up to the last multiple of the
    scheduling unit (their ref counts rise by one) and has computed exactly
    those tokens; the tokens after them are recomputed by the child's next
    ``schedule`` into its own blocks, so no block is ever written by two
    requests. ``dst`` must be empty. Attention groups only (a Mamba state
    cannot be shared half-way).
    """
    if layout.mamba_groups:
        raise ValueError("fork does not support Mamba groups")
    unit = layout.scheduler_block_size
    shared = jnp.where(state.status[src] == RUNNING, state.num_computed[src] // unit * unit, 0)
    nfull = shared // jnp.array(layout.block_sizes, jnp.int32)         # i32[G]
    keep = jnp.arange(layout.max_blocks)[None, :] < nfull[:, None]
    rows = jnp.where(keep, state.tables[src], 0)                       # i32[G, M]
    held = jnp.where(rows > 0, rows, layout.num_blocks).reshape(-1)
    pool = replace(
        state.block_pool.free_queue, ref_count=state.block_pool.free_queue.ref_count.at[held].add(1, mode="drop")
    )

    def copy(a):
        return a.at[dst].set(a[src])
    return replace(
        state,
        block_pool=replace(state.block_pool, free_queue=pool),
        tokens=copy(state.tokens), salt=copy(state.salt), hashes=copy(state.hashes),
        tables=state.tables.at[dst].set(rows),
    ).with_counters(dst, status=jnp.where(shared > 0, RUNNING, WAITING), num_tokens=state.num_tokens[src],
                    num_computed=shared, table_len=nfull, last_state=-1, retired=0,
                    num_cached=jnp.minimum(state.num_cached[src], nfull))


def reset_prefix_cache(layout: Layout, state: AllocatorState) -> tuple[AllocatorState, jax.Array]:
    """Drop every cache entry if no block is held; returns (state, ok)."""
    ok = state.block_pool.free_queue.num_free == layout.num_blocks - 1
    fresh = prefix_cache.reset(state.block_pool.prefix_cache)
    cache = jax.tree.map(lambda a, b: jnp.where(ok, a, b), fresh, state.block_pool.prefix_cache)
    return replace(state, block_pool=block_pool.BlockPool(free_queue=state.block_pool.free_queue, prefix_cache=cache),
                   step_cached=jnp.where(ok, False, state.step_cached)), ok


def new_step(layout: Layout, state: AllocatorState, renumber: bool = True) -> AllocatorState:
    """A scheduler step begins: Mamba states cached in the previous step may now serve hits. Call it
    once per step: it also renumbers the prefix cache's insertion clock before it nears int32's end.

    ``renumber`` (static) False leaves the clock alone: a program of several steps renumbers once, before
    them (the clock moves by at most a block per request and group a step, against 2^30 of headroom), so
    that its steps hold no conditional (on a GPU each reads its predicate back to the host)."""
    del layout
    cache = state.block_pool.prefix_cache
    if renumber:
        cache = jax.lax.cond(cache.clock >= prefix_cache.CLOCK_LIMIT, prefix_cache.renumber_clock, lambda c: c,
                             cache)
    return replace(
        state, block_pool=replace(state.block_pool, prefix_cache=cache), step_cached=jnp.zeros_like(state.step_cached)
    )
