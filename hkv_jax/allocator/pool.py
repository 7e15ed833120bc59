"""The block pool as a pytree: ref counts and the LRU free queue, updated by pure jitted functions.

vLLM keeps the free queue as a doubly linked list of block objects. Here the
queue is an array of *ranks*: a free block's position in the queue is its
rank, smaller first; a held block has rank ``HELD``. Then

- popping ``n`` blocks from the head is one ``lax.top_k`` over the ranks,
- putting blocks at the front gives them ranks below the current head
  (``front`` counts down), at the back ranks above the tail (``back`` counts
  up), in the order given,
- taking a block out of the queue (a prefix-cache hit on a free block) is
  setting its rank to ``HELD``,

all vectorised, with the exact order of vLLM's list (``SEMANTICS.md``, "Free
queue and eviction"). The null block 0 is never in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

HELD = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BlockPool:
    """Ref counts and free-queue order of ``num_blocks`` blocks (block 0 = null block).

    Fields:
      ref_count: ``i32[num_blocks]`` requests (table entries) holding each block.
      rank: ``i32[num_blocks]`` queue position of a free block (smaller = popped first); ``HELD`` otherwise.
      front: ``i32[]`` rank the next block put at the front gets (+1).
      back: ``i32[]`` rank the next block put at the back gets.
      num_free: ``i32[]`` blocks in the queue.
    """

    ref_count: jax.Array
    rank: jax.Array
    front: jax.Array
    back: jax.Array
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
        rank=jnp.where(ids == 0, HELD, ids),
        front=jnp.int32(0),
        back=jnp.int32(num_blocks),
        num_free=jnp.int32(num_blocks - 1),
    )


def pop_free(pool: BlockPool, count: jax.Array, max_count: int) -> tuple[BlockPool, jax.Array]:
    """Take ``count`` (<= ``max_count``, static) blocks from the head of the queue.

    Returns the new pool and ``i32[max_count]`` block ids in queue order, 0 past
    ``count``. The caller checks ``count <= num_free`` first (all-or-nothing
    allocation); the taken blocks get ref count 1.
    """
    k = min(max_count, pool.num_blocks)  # a request may want more entries than the pool has blocks
    _, ids = jax.lax.top_k(-pool.rank, k)
    ids = jnp.pad(ids, (0, max_count - k))
    take = jnp.arange(max_count) < count
    ids = jnp.where(take, ids, 0).astype(jnp.int32)
    # Scatter with a dump slot for the untaken lanes so that block 0 is never touched.
    tgt = jnp.where(take, ids, pool.num_blocks)
    rank = jnp.append(pool.rank, 0).at[tgt].set(HELD)[:-1]
    ref = jnp.append(pool.ref_count, 0).at[tgt].set(1)[:-1]
    return replace(pool, rank=rank, ref_count=ref, num_free=pool.num_free - jnp.minimum(count, max_count)), ids


def touch(pool: BlockPool, blocks: jax.Array) -> BlockPool:
    """Add one reference to each non-null id in ``blocks`` (a hit); free ones leave the queue."""
    valid = blocks > 0
    tgt = jnp.where(valid, blocks, pool.num_blocks)
    ref = jnp.append(pool.ref_count, 0).at[tgt].add(1)[:-1]
    left = (pool.ref_count == 0) & (ref > 0)
    rank = jnp.where(left, HELD, pool.rank)
    return replace(pool, ref_count=ref, rank=rank, num_free=pool.num_free - jnp.sum(left, dtype=jnp.int32))


def free_ordered(pool: BlockPool, blocks: jax.Array, cached: jax.Array) -> BlockPool:
    """Drop one reference from each non-null id in ``blocks``, given in eviction priority order.

    A block whose count reaches 0 joins the queue: at the front when it holds
    no cache entry (``cached[b]`` False; the first such block becomes the
    head), at the back otherwise (in the given order). ``cached`` is
    ``bool[num_blocks]``. A block may appear once in ``blocks``.
    """
    valid = blocks > 0
    tgt = jnp.where(valid, blocks, pool.num_blocks)
    ref = jnp.append(pool.ref_count, 0).at[tgt].add(-1)[:-1]
    now_free = valid & (ref[jnp.where(valid, blocks, 0)] == 0)
    is_cached = cached[jnp.where(valid, blocks, 0)]
    to_front = now_free & ~is_cached
    to_back = now_free & is_cached
    n_front = jnp.sum(to_front, dtype=jnp.int32)
    n_back = jnp.sum(to_back, dtype=jnp.int32)
    front_rank = pool.front - n_front + jnp.cumsum(to_front, dtype=jnp.int32) - 1
    back_rank = pool.back + jnp.cumsum(to_back, dtype=jnp.int32) - 1
    new_rank = jnp.where(to_front, front_rank, back_rank)
    rank = jnp.append(pool.rank, 0).at[jnp.where(now_free, blocks, pool.num_blocks)].set(new_rank)[:-1]
    return BlockPool(
        ref_count=ref,
        rank=rank,
        front=pool.front - n_front,
        back=pool.back + n_back,
        num_free=pool.num_free + n_front + n_back,
    )


def queue_order(pool: BlockPool) -> jax.Array:
    """The free blocks in queue order (host-side helper for tests and debugging)."""
    order = jnp.argsort(pool.rank)
    return order[: int(pool.num_free)]
