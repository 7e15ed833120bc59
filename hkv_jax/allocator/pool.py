"""The block pool as a pytree: ref counts and the LRU free queue, updated by pure jitted functions.

vLLM keeps the free queue as a doubly linked list of block objects. Here it is
a circular array ``queue`` of block ids between two absolute positions
``head`` and ``tail``, plus each free block's position ``pos``. Then

- popping ``n`` blocks from the head reads a window of ``n + HOLE_SLACK``
  entries after ``head`` (no pass over the whole pool),
- putting blocks at the front writes them just before ``head``, at the back
  just after ``tail``, in the order given,
- taking a block out of the queue (a prefix-cache hit on a free block) leaves
  a hole (id 0) that pops skip,

all with O(number of blocks moved) updates and vLLM's exact order
(``SEMANTICS.md``, "Free queue and eviction"). When holes crowd the window or
the span ``tail - head`` would exceed the array, the queue is compacted once
(O(num_blocks), rare). The null block 0 is never in the queue.
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
class BlockPool:
    """Ref counts and free-queue order of ``num_blocks`` blocks (block 0 = null block).

    Fields:
      ref_count: ``i32[num_blocks]`` requests (table entries) holding each block.
      queue: ``i32[num_blocks]`` circular array of free block ids in queue order, 0 = hole; entries
        outside ``[head, tail)`` are stale (never read).
      pos: ``i32[num_blocks]`` absolute queue position of each free block (``ref_count == 0``); stale
        for a held block (read only when the block is free), -1 for the null block.
      head: ``i32[]`` absolute position of the first queue entry (``queue[head % num_blocks]``).
      tail: ``i32[]`` absolute position one past the last entry.
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


def init_pool(num_blocks: int) -> BlockPool:
    """A pool with blocks ``1..num_blocks-1`` free, in id order; block 0 held forever as the null block."""
    if num_blocks < 2:
        raise ValueError(f"a pool needs at least 2 blocks (null block included), got {num_blocks}")
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    return BlockPool(
        ref_count=jnp.zeros(num_blocks, jnp.int32),
        queue=jnp.roll(ids, -1).at[-1].set(0),  # 1, 2, ..., N-1, then an empty slot
        pos=ids - 1,
        head=jnp.int32(0),
        tail=jnp.int32(num_blocks - 1),
        num_free=jnp.int32(num_blocks - 1),
    )


def compact(pool: BlockPool) -> BlockPool:
    """The same queue without holes, starting at position 0 (O(num_blocks))."""
    n = pool.num_blocks
    abs_pos = pool.head + jnp.arange(n)
    entries = jnp.where(abs_pos < pool.tail, pool.queue[abs_pos % n], 0)
    valid = entries > 0
    new_pos = running_count(valid) - 1
    queue = jnp.zeros(n, jnp.int32).at[jnp.where(valid, new_pos, n)].set(entries, mode="drop")
    pos = jnp.full(n, -1, jnp.int32).at[jnp.where(valid, entries, n)].set(new_pos, mode="drop")
    return replace(pool, queue=queue, pos=pos, head=jnp.int32(0), tail=pool.num_free)


class PopPlan(NamedTuple):
    """Which queue entries a pop takes (``pop_plan``); applied by ``pop_apply``."""

    ids: jax.Array      # i32[max_count]: block ids in queue order, 0 past the count
    take: jax.Array     # bool[width]: window lanes taken
    entries: jax.Array  # i32[width]: the window after the head
    enough: jax.Array   # bool[]: the window held ``count`` blocks (else the queue needs compacting)


def pop_plan(pool: BlockPool, count: jax.Array, max_count: int, slack: int = HOLE_SLACK) -> PopPlan:
    """Read-only: the first ``count`` (<= ``max_count``, static) blocks of the queue, from a window of
    ``max_count + slack`` entries after the head (holes skipped)."""
    n = pool.num_blocks
    width = min(max_count + slack, n)
    abs_pos = pool.head + jnp.arange(width)
    entries = jnp.where(abs_pos < pool.tail, pool.queue[abs_pos % n], 0)
    lanes = jnp.arange(width)

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


def pop_apply(pool: BlockPool, plan: PopPlan, hold: bool = True) -> BlockPool:
    """Take the blocks of ``plan`` (made on this pool) out of the queue, with ref count 1; ``hold``
    (static) False leaves their ref counts (0) to the caller, which counts them with its other
    references in one update.

    Only ``head`` moves: the taken entries fall before it, outside the live range ``[head, tail)``
    that every reader masks by, and a held block's ``pos`` is read by no one (see ``BlockPool``), so
    neither array is written (two scatters of the whole window saved).
    """
    lanes = jnp.arange(plan.take.shape[0])
    last = jnp.max(jnp.where(plan.take, lanes, -1))
    if hold:
        pool = replace(pool, ref_count=pool.ref_count.at[jnp.where(plan.take, plan.entries, pool.num_blocks)].set(
            1, mode="drop"))
    return replace(pool, head=pool.head + last + 1, num_free=pool.num_free - jnp.sum(plan.take, dtype=jnp.int32))


def pop_free(pool: BlockPool, count: jax.Array, max_count: int, slack: int = HOLE_SLACK) -> tuple[BlockPool, jax.Array]:
    """Take ``count`` (<= ``max_count``, static) blocks from the head of the queue.

    ``slack`` (static): holes the head window tolerates before the queue is compacted.

    Returns the new pool and ``i32[max_count]`` block ids in queue order, 0 past
    ``count``. The caller checks ``count <= num_free`` first (all-or-nothing
    allocation); the taken blocks get ref count 1.
    """
    plan = pop_plan(pool, count, max_count, slack)

    def compacted(p: BlockPool):
        p = compact(p)
        return p, pop_plan(p, count, max_count, slack)

    pool, plan = jax.lax.cond(plan.enough, lambda p: (p, plan), compacted, pool)
    return pop_apply(pool, plan), plan.ids


def touch(pool: BlockPool, blocks: jax.Array) -> BlockPool:
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


def free_ordered(pool: BlockPool, blocks: jax.Array, cached: jax.Array) -> BlockPool:
    """Drop one reference from each non-null id in ``blocks``, given in eviction priority order.

    A block whose count reaches 0 joins the queue: at the front when it holds
    no cache entry (``cached[i]`` False for ``blocks[i]``; the first such block
    becomes the head), at the back otherwise (in the given order). A block may
    appear once in ``blocks``.
    """
    n = pool.num_blocks
    valid = blocks > 0
    ref = pool.ref_count.at[jnp.where(valid, blocks, n)].add(-1, mode="drop")
    now_free = valid & (ref[jnp.where(valid, blocks, 0)] == 0)
    to_front = now_free & ~cached
    to_back = now_free & cached
    n_front = jnp.sum(to_front, dtype=jnp.int32)
    n_back = jnp.sum(to_back, dtype=jnp.int32)
    pool = replace(pool, ref_count=ref)
    pool = jax.lax.cond(pool.tail - pool.head + n_front + n_back > n, compact, lambda p: p, pool)
    new_pos = jnp.where(to_front, pool.head - n_front + jnp.cumsum(to_front, dtype=jnp.int32) - 1,
                        pool.tail + jnp.cumsum(to_back, dtype=jnp.int32) - 1)
    return replace(
        pool,
        queue=pool.queue.at[jnp.where(now_free, new_pos % n, n)].set(blocks, mode="drop"),
        pos=pool.pos.at[jnp.where(now_free, blocks, n)].set(new_pos, mode="drop"),
        head=pool.head - n_front,
        tail=pool.tail + n_back,
        num_free=pool.num_free + n_front + n_back,
    )


def queue_order(pool: BlockPool) -> list[int]:
    """The free blocks in queue order (host-side helper for tests and debugging)."""
    import numpy as np

    q, head, tail = np.asarray(pool.queue), int(pool.head), int(pool.tail)
    entries = [int(q[p % len(q)]) for p in range(head, tail)]
    return [b for b in entries if b > 0]
