"""vLLM's block pool in jnp: the free queue with its ref counts (``free_queue``) and the prefix cache
(``prefix_cache``).

Taking a block from the free queue evicts its cache entry (lazy eviction);
freeing sends cached blocks to the back of the queue and uncached ones to the
front. These are the only operations the per-type managers need from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hkv_jax.allocator import free_queue, prefix_cache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BlockPool:
    """Free queue + prefix cache of one block pool (``free_queue.FreeBlockQueue``, ``prefix_cache.PrefixCache``)."""

    free_queue: free_queue.FreeBlockQueue
    prefix_cache: prefix_cache.PrefixCache


def init_block_pool(num_blocks: int, num_groups: int = 1) -> BlockPool:
    """All blocks but the null block free, nothing cached (``num_groups`` KV cache groups)."""
    return BlockPool(
        free_queue=free_queue.init_free_queue(num_blocks),
        prefix_cache=prefix_cache.init_prefix_cache(num_blocks, num_groups=num_groups),
    )


def get_new_blocks(state: BlockPool, count: jax.Array, max_count: int) -> tuple[BlockPool, jax.Array]:
    """Pop ``count`` blocks (``<= max_count``, static) from the queue head, evicting their cache entries."""
    pool, ids = free_queue.pop_free(state.free_queue, count, max_count)
    cache = jax.lax.fori_loop(
        0, jnp.minimum(count, max_count), lambda i, c: prefix_cache.evict(c, ids[i]), state.prefix_cache
    )
    return BlockPool(free_queue=pool, prefix_cache=cache), ids


def free_blocks(state: BlockPool, blocks: jax.Array, front: bool = False) -> BlockPool:
    """Drop one reference from each non-null id in ``blocks`` (eviction priority order).

    ``front`` (static): freed blocks go to the front of the queue even when cached (they keep
    their cache entry until popped), except blocks that served a prefix hit: window-aware eviction.
    """
    queue = free_queue.free_ordered(state.free_queue, blocks, to_back(state.prefix_cache, blocks, front))
    return BlockPool(free_queue=queue, prefix_cache=state.prefix_cache)


def to_back(cache: prefix_cache.PrefixCache, blocks: jax.Array, early: jax.Array | bool = False) -> jax.Array:
    """Which of ``blocks`` go to the back of the free queue once free: those holding a cache entry,
    unless released ``early`` (leaving a window, window-aware eviction) without having served a hit."""
    b = jnp.maximum(blocks, 0)
    return (cache.block_slot[b] >= 0) & ~(early & ~cache.hit[b])


def touch(state: BlockPool, blocks: jax.Array) -> BlockPool:
    """A prefix hit: one more reference to each non-null id; free ones leave the queue."""
    return BlockPool(
        free_queue=free_queue.touch(state.free_queue, blocks), prefix_cache=mark_hit(state.prefix_cache, blocks)
    )


def mark_hit(cache: prefix_cache.PrefixCache, blocks: jax.Array) -> prefix_cache.PrefixCache:
    """Remember that the non-null ids in ``blocks`` served a prefix hit."""
    n = cache.hit.shape[0]
    return replace(cache, hit=cache.hit.at[jnp.where(blocks > 0, blocks, n)].set(True, mode="drop"))


def cache_blocks(state: BlockPool, blocks: jax.Array, hashes: jax.Array, group: jax.Array,
                 lo: jax.Array | int = 0, hi: jax.Array | int | None = None) -> BlockPool:
    """Enter each non-null ``blocks[i]``, ``lo <= i < hi``, under (``hashes[i]``, ``group``).

    A block's older entry, if any, is replaced. The loop runs over ``[lo, hi)`` only.
    """
    hi = blocks.shape[0] if hi is None else hi

    def one(i, c):
        b = blocks[i]
        return prefix_cache.insert(prefix_cache.evict(c, b), b, hashes[i], group)

    return BlockPool(free_queue=state.free_queue, prefix_cache=jax.lax.fori_loop(lo, hi, one, state.prefix_cache))
