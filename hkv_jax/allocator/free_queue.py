"""The free block queue as a pytree: ref counts and the LRU free queue (vLLM's ``FreeKVCacheBlockQueue``),
updated by pure jitted functions.

vLLM keeps the free queue as a doubly linked list of block objects. Here it is
a circular array ``queue`` of block ids between two ends ``head`` and ``tail``,
plus each free block's queue index ``pos``. Then

- popping ``n`` blocks from the head reads a window of ``n + HOLE_SLACK``
  entries after ``head`` (no pass over the whole pool),
- putting blocks at the front writes them just before ``head``, at the back
  just after ``tail``, in the order given,
- taking a block out of the queue (a prefix-cache hit on a free block) leaves
  a hole (id 0) that pops skip,

all with O(number of blocks moved) updates and vLLM's exact order
(``docs/SEMANTICS.md``, "Free queue and eviction"). When holes crowd the window or
the span ``tail - head`` would exceed the array, the queue is compacted once
(O(num_blocks), rare). The null block 0 is never in the queue.

Positions are modular: ``head`` is brought back into ``[0, num_blocks)`` after
every move and ``pos`` holds indices into ``queue``, so no counter grows with
the pool's age (a server that takes and frees blocks for weeks never wraps
int32). Readers work from ``head % num_blocks`` and the span ``tail - head``,
so any offset of the two ends is read correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

HOLE_SLACK = 32
_SCAN_MIN = 1 << 15  # from this length a log-depth scan beats XLA's CPU cumsum (a reduce-window): 2.3x at 256k


def running_count(flags: jax.Array) -> jax.Array:
    """``i32[n]``: how many of ``flags[: i + 1]`` (``bool[n]``) are set (an inclusive ``cumsum``)."""
    x = flags.astype(jnp.int32)
    return jax.lax.associative_scan(jnp.add, x) if x.shape[0] >= _SCAN_MIN else jnp.cumsum(x)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FreeBlockQueue:
    """Ref counts and free-queue order of ``num_blocks`` blocks (block 0 = null block).

    Fields:
      ref_count: ``i32[num_blocks]`` requests (table entries) holding each block.
      queue: ``i32[num_blocks]`` circular array of free block ids in queue order, 0 = hole; entries
        outside positions ``[head, tail)`` (taken modulo ``num_blocks``) are stale (never read).
      pos: ``i32[num_blocks]`` index into ``queue`` of each free block (``ref_count == 0``); stale
        for a held block (read only when the block is free), -1 for the null block.
      head: ``i32[]`` position of the first queue entry (``queue[head % num_blocks]``); kept in
        ``[0, num_blocks)``.
      tail: ``i32[]`` position one past the last entry: ``head <= tail <= head + num_blocks``.
      num_free: ``i32[]`` blocks in the queue.
    """

    ref_count: jax.Array
    queue: jax.Array
    pos: jax.Array
    head: jax.Array
    tail: jax.Array
    num_free: jax.Array

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, null block included (static)."""
        return self.ref_count.shape[0]


def _span(pool: FreeBlockQueue) -> tuple[jax.Array, jax.Array]:
    """(index of the head in ``queue``, entries between head and tail): the queue read from any offset."""
    return pool.head % pool.num_blocks, pool.tail - pool.head


def _with_ends(pool: FreeBlockQueue, head: jax.Array, tail: jax.Array, **fields) -> FreeBlockQueue:
    """``pool`` with the queue ends moved to ``head``/``tail`` (positions relative to ``_span``'s head
    index, within one lap of it), the head brought back into ``[0, num_blocks)``."""
    lap = jnp.floor_divide(head, pool.num_blocks) * pool.num_blocks
    return replace(pool, head=head - lap, tail=tail - lap, **fields)


def init_free_queue(num_blocks: int) -> FreeBlockQueue:
    """A pool with blocks ``1..num_blocks-1`` free, in id order; block 0 held forever as the null block."""
    if num_blocks < 2:
        raise ValueError(f"a pool needs at least 2 blocks (null block included), got {num_blocks}")
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    return FreeBlockQueue(
        ref_count=jnp.zeros(num_blocks, jnp.int32),
        queue=jnp.roll(ids, -1).at[-1].set(0),  # 1, 2, ..., N-1, then an empty slot
        pos=ids - 1,
        head=jnp.int32(0),
        tail=jnp.int32(num_blocks - 1),
        num_free=jnp.int32(num_blocks - 1),
    )


def compact(pool: FreeBlockQueue) -> FreeBlockQueue:
    """The same queue without holes, starting at position 0 (O(num_blocks))."""
    n = pool.num_blocks
    head, span = _span(pool)
    lanes = jnp.arange(n)
    entries = jnp.where(lanes < span, pool.queue[(head + lanes) % n], 0)
    valid = entries > 0
    new_pos = running_count(valid) - 1
    queue = jnp.zeros(n, jnp.int32).at[jnp.where(valid, new_pos, n)].set(entries, mode="drop")
    pos = jnp.full(n, -1, jnp.int32).at[jnp.where(valid, entries, n)].set(new_pos, mode="drop")
    return replace(pool, queue=queue, pos=pos, head=jnp.int32(0), tail=pool.num_free)


def move_behind(pool: FreeBlockQueue, ahead: jax.Array, blocks: jax.Array) -> FreeBlockQueue:
    """The queue with the free blocks ``blocks`` (``i32[K]``, distinct, 0 = none) moved, in that order, right
    behind the free blocks ``ahead`` marks (``bool[num_blocks]``, by block id; none of ``blocks``); the others
    keep their order after them. Compacted on the way (O(num_blocks))."""
    n = pool.num_blocks
    head, span = _span(pool)
    lanes = jnp.arange(n)
    entries = jnp.where(lanes < span, pool.queue[(head + lanes) % n], 0)
    moved = jnp.zeros(n, bool).at[blocks].set(blocks > 0)
    first = (entries > 0) & ahead[entries]
    rest = (entries > 0) & ~first & ~moved[entries]
    lead, count = jnp.sum(first, dtype=jnp.int32), jnp.sum(blocks > 0, dtype=jnp.int32)
    at = jnp.where(first, running_count(first) - 1, jnp.where(rest, lead + count + running_count(rest) - 1, n))
    at_moved = jnp.where(blocks > 0, lead + jnp.arange(blocks.shape[0]), n)   # ``blocks`` are 0-padded at the end
    queue = jnp.zeros(n, jnp.int32).at[at].set(entries, mode="drop").at[at_moved].set(blocks, mode="drop")
    pos = pool.pos.at[jnp.where(at < n, entries, n)].set(at, mode="drop")
    pos = pos.at[jnp.where(blocks > 0, blocks, n)].set(at_moved, mode="drop")
    return replace(pool, queue=queue, pos=pos, head=jnp.int32(0), tail=pool.num_free)


class PopPlan(NamedTuple):
    """Which queue entries a pop takes (``pop_plan``); applied by ``pop_apply``."""

    ids: jax.Array      # i32[max_count]: block ids in queue order, 0 past the count
    take: jax.Array     # bool[width]: window lanes taken
    entries: jax.Array  # i32[width]: the window after the head
    enough: jax.Array   # bool[]: the window held ``count`` blocks (else the queue needs compacting)


def pop_plan(pool: FreeBlockQueue, count: jax.Array, max_count: int, slack: int = HOLE_SLACK) -> PopPlan:
    """Read-only: the first ``count`` (<= ``max_count``, static) blocks of the queue, from a window of
    ``max_count + slack`` entries after the head (holes skipped)."""
    n = pool.num_blocks
    width = min(max_count + slack, n)
    head, span = _span(pool)
    lanes = jnp.arange(width)
    entries = jnp.where(lanes < span, pool.queue[(head + lanes) % n], 0)

    def solid():
        """No hole among the first ``count`` entries (the usual case): they are the blocks."""
        ids = jnp.where(lanes < count, entries, 0)
        return jnp.pad(ids, (0, max(max_count - width, 0)))[:max_count], lanes < count, jnp.bool_(True)

    def holes():
        rank = running_count(entries > 0)
        take = (entries > 0) & (rank <= count)
        # Slot of the k-th taken block is where rank first reaches k.
        ids = jnp.zeros(max_count, jnp.int32).at[jnp.where(take, rank - 1, max_count)].set(entries, mode="drop")
        return ids, take, rank[-1] >= jnp.minimum(count, pool.num_free)

    ids, take, enough = jax.lax.cond(jnp.all((lanes >= count) | (entries > 0)), solid, holes)
    return PopPlan(ids, take, entries, enough)


def pop_apply(pool: FreeBlockQueue, plan: PopPlan, hold: bool = True) -> FreeBlockQueue:
    """Take the blocks of ``plan`` (made on this pool) out of the queue, with ref count 1; ``hold``
    (static) False leaves their ref counts (0) to the caller, which counts them with its other
    references in one update.

    Only ``head`` moves: the taken entries fall before it, outside the live range ``[head, tail)``
    that every reader masks by, and a held block's ``pos`` is read by no one (see ``FreeBlockQueue``), so
    neither array is written (two scatters of the whole window saved).
    """
    lanes = jnp.arange(plan.take.shape[0])
    last = jnp.max(jnp.where(plan.take, lanes, -1))
    if hold:
        pool = replace(pool, ref_count=pool.ref_count.at[jnp.where(plan.take, plan.entries, pool.num_blocks)].set(
            1, mode="drop"))
    head, span = _span(pool)
    return _with_ends(pool, head + last + 1, head + span,
                      num_free=pool.num_free - jnp.sum(plan.take, dtype=jnp.int32))


def pop_prefix(plan: PopPlan, count: jax.Array) -> PopPlan:
    """The first ``count`` blocks of ``plan`` (at most its count): a smaller pop from the same queue."""
    return PopPlan(jnp.where(jnp.arange(plan.ids.shape[0]) < count, plan.ids, 0),
                   plan.take & (running_count(plan.take) <= count), plan.entries, plan.enough)


def pop_free(
    pool: FreeBlockQueue, count: jax.Array, max_count: int, slack: int = HOLE_SLACK
) -> tuple[FreeBlockQueue, jax.Array]:
    """Take ``count`` (<= ``max_count``, static) blocks from the head of the queue.

    ``slack`` (static): holes the head window tolerates before the queue is compacted.

    Returns the new pool and ``i32[max_count]`` block ids in queue order, 0 past
    ``count``. The caller checks ``count <= num_free`` first (all-or-nothing
    allocation); the taken blocks get ref count 1.
    """
    plan = pop_plan(pool, count, max_count, slack)

    def compacted(p: FreeBlockQueue):
        p = compact(p)
        return p, pop_plan(p, count, max_count, slack)

    pool, plan = jax.lax.cond(plan.enough, lambda p: (p, plan), compacted, pool)
    return pop_apply(pool, plan), plan.ids


def touch(pool: FreeBlockQueue, blocks: jax.Array) -> FreeBlockQueue:
    """Add one reference to each non-null id in ``blocks`` (distinct ids; a hit); free ones leave the queue."""
    n = pool.num_blocks
    valid = blocks > 0
    b = jnp.where(valid, blocks, 0)
    was_free = valid & (pool.ref_count[b] == 0)
    return replace(
        pool,
        ref_count=pool.ref_count.at[jnp.where(valid, blocks, n)].add(1, mode="drop"),
        queue=pool.queue.at[jnp.where(was_free, pool.pos[b] % n, n)].set(0, mode="drop"),
        num_free=pool.num_free - jnp.sum(was_free, dtype=jnp.int32),
    )


class Release(NamedTuple):
    """Where the blocks of a batch of free calls go (``plan_free``); applied by ``apply_free``."""

    blocks: jax.Array    # i32[C, W]: call c drops one reference from each non-null blocks[c, i]
    now_free: jax.Array  # bool[C, W]: the entry that drops the block's last reference
    to_front: jax.Array  # bool[C, W]: ... and the block goes to the front of the queue (uncached)
    fits: jax.Array      # bool[]: the queue array has room for them without compaction


def plan_free(pool: FreeBlockQueue, blocks: jax.Array, cached: jax.Array, distinct: bool = False) -> Release:
    """Read-only: where the blocks of ``C`` free calls go, one call per row of ``blocks: i32[C, W]``
    (each row in eviction priority order, 0 = none; ``cached: bool[C, W]``: the block keeps a cache
    entry, so it goes to the back). A block may appear in several calls (requests sharing it): it is
    free after the last. ``distinct`` (static): the caller knows every id appears once (cheaper)."""
    N = pool.num_blocks
    flat = blocks.reshape(-1)
    K = flat.shape[0]
    valid = flat > 0
    fb = jnp.where(valid, flat, 0)
    lane = jnp.arange(K, dtype=jnp.int32)
    if distinct or K == 0:
        drops, is_last = jnp.ones(K, jnp.int32), jnp.ones(K, bool)
    elif K * 8 >= N:  # many entries: count them in pool-sized arrays (O(K + N))
        at = jnp.where(valid, flat, N)
        drops = jnp.zeros(N, jnp.int32).at[at].add(1, mode="drop")[fb]
        is_last = jnp.full(N, -1, jnp.int32).at[at].max(lane, mode="drop")[fb] == lane
    else:  # few: runs of equal ids in a stable sort give each id's count and last entry (O(K log K))
        order = jnp.argsort(flat, stable=True)
        ids = flat[order]
        starts = jnp.concatenate([jnp.ones(1, bool), ids[1:] != ids[:-1]])
        ends = jnp.concatenate([ids[1:] != ids[:-1], jnp.ones(1, bool)])
        run_start = jax.lax.cummax(jnp.where(starts, lane, 0))
        run_end = jax.lax.cummin(jnp.where(ends, lane, K), reverse=True)
        drops = jnp.zeros(K, jnp.int32).at[order].set(run_end - run_start + 1)
        is_last = jnp.zeros(K, bool).at[order].set(ends)
    now_free = valid & (pool.ref_count[fb] == drops) & is_last
    to_front = now_free & ~cached.reshape(-1)
    fits = pool.tail - pool.head + jnp.sum(now_free, dtype=jnp.int32) <= N
    return Release(blocks, now_free.reshape(blocks.shape), to_front.reshape(blocks.shape), fits)


def apply_free(pool: FreeBlockQueue, rel: Release) -> FreeBlockQueue:
    """Drop one reference per entry of ``rel`` (``plan_free`` on this pool); blocks reaching 0 join the
    queue as one call each would put them: at the front when uncached (a later call's blocks in front
    of an earlier call's, each call's in its own order, its first block the new head), at the back
    otherwise (in call order). Needs ``rel.fits`` (``free_calls`` compacts first where it does not)."""
    N = pool.num_blocks
    flat, now_free, to_front = rel.blocks.reshape(-1), rel.now_free.reshape(-1), rel.to_front.reshape(-1)
    to_back = now_free & ~to_front
    front = rel.to_front.astype(jnp.int32)                                   # [C, W]
    per_call = jnp.sum(front, axis=1)
    later_calls = jnp.cumsum(per_call[::-1])[::-1] - per_call                 # front blocks of later calls
    front_rank = (later_calls[:, None] + jnp.cumsum(front, axis=1) - front).reshape(-1)
    n_front, n_back = jnp.sum(to_front, dtype=jnp.int32), jnp.sum(to_back, dtype=jnp.int32)
    head, span = _span(pool)
    new_pos = jnp.where(to_front, head - n_front + front_rank,
                        head + span + jnp.cumsum(to_back, dtype=jnp.int32) - 1) % N
    return _with_ends(
        pool, head - n_front, head + span + n_back,
        ref_count=pool.ref_count.at[jnp.where(flat > 0, flat, N)].add(-1, mode="drop"),
        queue=pool.queue.at[jnp.where(now_free, new_pos, N)].set(flat, mode="drop"),
        pos=pool.pos.at[jnp.where(now_free, flat, N)].set(new_pos, mode="drop"),
        num_free=pool.num_free + n_front + n_back)


class Interleaved(NamedTuple):
    """Where the pops of requests that free blocks and then take some come from (``pops_after_releases``)."""

    ids: jax.Array       # i32[B, P]: request r's i-th block, where it is one of the step's releases (else 0)
    old_rank: jax.Array  # i32[B, P]: ... else its rank among the pops from the queue as it was (-1: no pop)
    old_count: jax.Array  # i32[]: pops from the queue as it was
    release: Release     # the releases less those taken again in the step (they never join the queue)


def _last_at_most(values: jax.Array, before: jax.Array, limit: jax.Array) -> jax.Array:
    """Per query: the largest ``j < before`` with ``values[j] <= limit`` (-1: none). ``values: i32[n]``;
    ``before, limit``: any shape. Binary lifting over range minima, O(n log n + queries log n)."""
    n = values.shape[0]
    levels = [values]  # levels[k][i] = min(values[i : i + 2**k])
    while 2 ** len(levels) <= n:
        prev, span = levels[-1], 2 ** (len(levels) - 1)
        levels.append(jnp.minimum(prev, jnp.concatenate([prev[span:], jnp.full(span, jnp.iinfo(jnp.int32).max)])))
    pos = before
    for k in reversed(range(len(levels))):
        start = pos - 2 ** k
        pos = jnp.where((start >= 0) & (levels[k][jnp.maximum(start, 0)] > limit), start, pos)
    return pos - 1


def pops_after_releases(rel: Release, pops: jax.Array, max_pops: int) -> Interleaved:
    """Read-only: requests ``r = 0 .. B-1`` in turn make their free calls (rows ``r*K .. r*K+K-1`` of
    ``rel``, planned by ``plan_free``; ``K = C // B``), then take ``pops[r]`` (<= ``max_pops``, static)
    blocks from the head. Blocks freed to the front sit before the older free blocks, so a pop takes
    the latest of them not yet taken, and the queue as it was only when none is left: a stack on top
    of the queue. Heights: ``h_r = max(h_{r-1} + front_r - pops_r, 0)``; a pop at height ``p`` finds
    the block of the last request whose push started at or below ``p``; a pushed block stays free iff
    the height never falls to its position again. The same blocks as one request after another."""
    C, W = rel.blocks.shape
    B = pops.shape[0]
    K = C // B
    i = jnp.arange(max_pops)[None, :]

    def queue_only():
        """No block freed to the front (or no pop): every pop reads the queue as it was."""
        old_rank = jnp.where(i < pops[:, None], (jnp.cumsum(pops) - pops)[:, None] + i, -1)
        return Interleaved(jnp.zeros((B, max_pops), jnp.int32), old_rank, jnp.sum(pops), rel)

    if C * W == 0:
        return queue_only()

    def with_stack():
        front = rel.to_front.reshape(B, K, W).astype(jnp.int32)
        per_call = jnp.sum(front, axis=2)                                       # [B, K]
        later = jnp.cumsum(per_call[:, ::-1], axis=1)[:, ::-1] - per_call       # front blocks of later calls
        rank = later[:, :, None] + jnp.cumsum(front, axis=2) - front            # 0: the request's new head
        u = jnp.sum(per_call, axis=1)                                           # [B]
        level = jnp.cumsum(u - pops)
        after = level - jnp.minimum(jax.lax.cummin(level), 0)                   # stack height after request r
        before = jnp.concatenate([jnp.zeros(1, after.dtype), after[:-1]])
        from_stack = jnp.minimum(pops, before + u)
        old = pops - from_stack
        stacked = i < from_stack[:, None]
        height = before[:, None] + u[:, None] - 1 - i                           # [B, P] position popped
        r = jnp.arange(B)[:, None]
        j = jnp.where(i < u[:, None], r, _last_at_most(before, jnp.broadcast_to(r, height.shape), height))
        j = jnp.maximum(j, 0)
        start = jnp.cumsum(u) - u                                               # request r's blocks in ``pushed``
        at = jnp.where(rel.to_front.reshape(B, K, W), start[:, None, None] + rank, C * W)
        pushed = jnp.zeros(C * W, jnp.int32).at[at.reshape(-1)].set(rel.blocks.reshape(-1), mode="drop")
        ids = jnp.where(stacked, pushed[jnp.clip(start[j] + before[j] + u[j] - 1 - height, 0, C * W - 1)], 0)
        old_rank = jnp.where(~stacked & (i < pops[:, None]),
                             (jnp.cumsum(old) - old)[:, None] + i - from_stack[:, None], -1)
        # A pushed block is taken again iff the height falls to its position at or after its request.
        lowest = jax.lax.cummin(after, reverse=True)
        taken = rel.to_front & ((before + u)[:, None, None] - 1 - rank >= lowest[:, None, None]).reshape(C, W)
        kept = rel._replace(now_free=rel.now_free & ~taken, to_front=rel.to_front & ~taken)
        return Interleaved(ids, old_rank, jnp.sum(old), kept)

    # The usual busy step (vLLM's order: out-of-window blocks are cached, so they go to the back) skips
    # the passes over every release entry.
    return jax.lax.cond(jnp.any(rel.to_front) & jnp.any(pops > 0), with_stack, queue_only)


def free_calls(pool: FreeBlockQueue, blocks: jax.Array, cached: jax.Array, distinct: bool = False) -> FreeBlockQueue:
    """``C`` free calls at once (``plan_free``, then ``apply_free``; the queue compacted first when the
    array has no room): the same queue as one call after another."""
    rel = plan_free(pool, blocks, cached, distinct)
    pool = jax.lax.cond(rel.fits, lambda p: p, compact, pool)
    return apply_free(pool, rel)


def free_ordered(pool: FreeBlockQueue, blocks: jax.Array, cached: jax.Array) -> FreeBlockQueue:
    """One free call: drop one reference from each non-null id in ``blocks`` (each at most once),
    given in eviction priority order.

    A block whose count reaches 0 joins the queue: at the front when it holds
    no cache entry (``cached[i]`` False for ``blocks[i]``; the first such block
    becomes the head), at the back otherwise (in the given order).
    """
    return free_calls(pool, blocks[None], cached[None], distinct=True)


def queue_order(pool: FreeBlockQueue) -> list[int]:
    """The free blocks in queue order (host-side helper for tests and debugging)."""
    import numpy as np

    q, head, span = np.asarray(pool.queue), int(pool.head) % pool.num_blocks, int(pool.tail) - int(pool.head)
    entries = [int(q[(head + i) % len(q)]) for i in range(span)]
    return [b for b in entries if b > 0]
