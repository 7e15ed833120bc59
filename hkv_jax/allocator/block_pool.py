"""vLLM's block pool layer in jnp: the free queue (``pool``) and the prefix cache (``prefix_cache``) together.

Taking a block from the free queue evicts its cache entry (lazy eviction);
freeing sends cached blocks to the back of the queue and uncached ones to the
front. These are the only operations the per-type managers need from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hkv_jax.allocator import pool as P
from hkv_jax.allocator import prefix_cache as pc


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BlockPoolState:
    """Free queue + prefix cache of one block pool (see ``pool.BlockPool`` and ``prefix_cache.PrefixCache``)."""

    pool: P.BlockPool
    cache: pc.PrefixCache


def init_block_pool(num_blocks: int, num_groups: int = 1) -> BlockPoolState:
    """All blocks but the null block free, nothing cached (``num_groups`` KV cache groups)."""
    return BlockPoolState(pool=P.init_pool(num_blocks), cache=pc.init_prefix_cache(num_blocks, num_groups=num_groups))


def get_new_blocks(state: BlockPoolState, count: jax.Array, max_count: int) -> tuple[BlockPoolState, jax.Array]:
    """Pop ``count`` blocks (``<= max_count``, static) from the queue head, evicting their cache entries."""
    pool, ids = P.pop_free(state.pool, count, max_count)
    cache = jax.lax.fori_loop(0, jnp.minimum(count, max_count), lambda i, c: pc.evict(c, ids[i]), state.cache)
    return BlockPoolState(pool=pool, cache=cache), ids


def free_blocks(state: BlockPoolState, blocks: jax.Array, front: bool = False) -> BlockPoolState:
    """Drop one reference from each non-null id in ``blocks`` (eviction priority order).

    ``front`` (static): freed blocks go to the front of the queue even when cached (they keep
    their cache entry until popped), except blocks that served a prefix hit: window-aware eviction.
    """
    return BlockPoolState(pool=P.free_ordered(state.pool, blocks, to_back(state.cache, blocks, front)),
                          cache=state.cache)


def to_back(cache: pc.PrefixCache, blocks: jax.Array, early: jax.Array | bool = False) -> jax.Array:
    """Which of ``blocks`` go to the back of the free queue once free: those holding a cache entry,
    unless released ``early`` (leaving a window, window-aware eviction) without having served a hit."""
    b = jnp.maximum(blocks, 0)
    return (cache.block_slot[b] >= 0) & ~(early & ~cache.hit[b])


def touch(state: BlockPoolState, blocks: jax.Array) -> BlockPoolState:
    """A prefix hit: one more reference to each non-null id; free ones leave the queue."""
    return BlockPoolState(pool=P.touch(state.pool, blocks), cache=mark_hit(state.cache, blocks))


def mark_hit(cache: pc.PrefixCache, blocks: jax.Array) -> pc.PrefixCache:
    """Remember that the non-null ids in ``blocks`` served a prefix hit."""
    n = cache.hit.shape[0]
    return replace(cache, hit=cache.hit.at[jnp.where(blocks > 0, blocks, n)].set(True, mode="drop"))


def cache_blocks(state: BlockPoolState, blocks: jax.Array, hashes: jax.Array, group: jax.Array,
                 lo: jax.Array | int = 0, hi: jax.Array | int | None = None) -> BlockPoolState:
    """Enter each non-null ``blocks[i]``, ``lo <= i < hi``, under (``hashes[i]``, ``group``).

    A block's older entry, if any, is replaced. The loop runs over ``[lo, hi)`` only.
    """
    hi = blocks.shape[0] if hi is None else hi

    def one(i, c):
        b = blocks[i]
        return pc.insert(pc.evict(c, b), b, hashes[i], group)

    return BlockPoolState(pool=state.pool, cache=jax.lax.fori_loop(lo, hi, one, state.cache))
