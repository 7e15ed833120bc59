"""Free queue + prefix cache together (lazy eviction on reuse) against the plain-Python model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv_jax.allocator import block_pool, free_queue, prefix_cache
from hkv_jax.allocator.pymodel import PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec

N, K = 6, 4
get = jax.jit(block_pool.get_new_blocks, static_argnums=2)
free = jax.jit(block_pool.free_blocks)
touch = jax.jit(block_pool.touch)
cache = jax.jit(block_pool.cache_blocks)
HASHES = [np.array([h, 3 * h + 1, 7, 9], np.uint32) for h in range(4)]
KEYS = jnp.asarray(np.stack(HASHES))
lookup = jax.jit(prefix_cache.lookup)

op = st.one_of(
    st.tuples(st.just("get"), st.integers(0, K)),
    st.tuples(st.just("free"), st.lists(st.integers(1, N - 1), max_size=K, unique=True)),
    st.tuples(st.just("touch"), st.lists(st.integers(1, N - 1), max_size=K, unique=True)),
    st.tuples(st.just("cache"), st.lists(st.tuples(st.integers(1, N - 1), st.integers(0, 3)), max_size=K,
                                         unique_by=lambda x: x[0])),
)


def pad(xs, n=K):
    return jnp.array(list(xs) + [0] * (n - len(xs)), jnp.int32)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=3, max_size=30))
def test_block_pool_matches_the_model(ops):
    model = PyAllocator(plan([FullAttentionSpec(name="l", num_kv_heads=1, head_size=8)], num_blocks=N), 64)
    state = block_pool.init_block_pool(N)
    for kind, arg in ops:
        if kind == "get":
            if arg > model.num_free_blocks:
                continue
            state, ids = get(state, jnp.int32(arg), K)
            assert list(np.asarray(ids[:arg])) == model._pop_free(arg)
        elif kind == "free":
            held = [b for b in arg if model.ref[b] > 0]
            state = free(state, pad(held))
            model._free_blocks(held)
        elif kind == "touch":
            state = touch(state, pad(arg))
            model._touch(arg)
        else:
            held = [(b, h) for b, h in arg if model.ref[b] > 0]  # only computed (held) blocks get cached
            hs = np.zeros((K, 4), np.uint32)
            for i, (b, h) in enumerate(held):
                hs[i] = HASHES[h]
                model._evict(b)
                model.hash[b] = (h, 0)
                model.cache.setdefault((h, 0), []).append(b)
            state = cache(state, pad([b for b, _ in held]), jnp.asarray(hs), jnp.int32(0))
        assert free_queue.queue_order(state.free_queue) == model.free_queue
        assert list(np.asarray(state.free_queue.ref_count)) == model.ref
        got = np.asarray(lookup(state.prefix_cache, KEYS, jnp.zeros(len(HASHES), jnp.int32)))
        assert list(got) == [model.cache.get((h, 0), [0])[0] for h in range(4)]


@pytest.mark.parametrize("n", [1000, free_queue._SCAN_MIN + 123])  # cumsum, then the log-depth scan
def test_running_count_is_a_cumsum(n):
    flags = np.random.default_rng(n).random(n) < 0.3
    got = jax.jit(free_queue.running_count)(jnp.asarray(flags))
    assert got.dtype == jnp.int32 and np.array_equal(np.asarray(got), np.cumsum(flags))


@pytest.mark.parametrize("seed", range(4))
def test_pops_after_releases_match_one_request_after_another(seed):
    """Requests free blocks (some to the front) then take some, one after another, on a plain list:
    the same blocks taken, from the same places, and the same blocks left at the front in order."""
    rng = np.random.default_rng(seed)
    B, calls, W, most = 9, 2, 3, 4
    blocks = rng.permutation(np.arange(1, 1 + B * calls * W)).reshape(B * calls, W).astype(np.int32)
    blocks[rng.random(blocks.shape) < 0.2] = 0
    to_front = (blocks > 0) & (rng.random(blocks.shape) < [0.7, 0.3, 0.0][seed % 3])
    pops = rng.integers(0, most + 1, B).astype(np.int32)
    rel = free_queue.Release(jnp.asarray(blocks), jnp.asarray(blocks > 0), jnp.asarray(to_front), jnp.bool_(True))
    got = jax.jit(free_queue.pops_after_releases, static_argnums=2)(rel, jnp.asarray(pops), most)

    queue, old = [], iter(range(-1, -1000, -1))  # negative ids: the queue as it was
    taken = []
    for r in range(B):
        for c in range(r * calls, (r + 1) * calls):
            queue = [int(b) for b, f in zip(blocks[c], to_front[c]) if f] + queue
        taken.append([queue.pop(0) if queue else next(old) for _ in range(pops[r])])
    ids, old_rank = np.asarray(got.ids), np.asarray(got.old_rank)
    for r in range(B):
        want_ids = [b if b > 0 else 0 for b in taken[r]] + [0] * (most - pops[r])
        want_old = [-b - 1 if b < 0 else -1 for b in taken[r]] + [-1] * (most - pops[r])
        assert ids[r].tolist() == want_ids and old_rank[r].tolist() == want_old, r
    assert int(got.old_count) == sum(b < 0 for t in taken for b in t)
    # What stays at the front, as ``apply_free`` orders it: later calls first, each in its own order.
    kept = np.asarray(got.release.to_front)
    front = [int(b) for c in range(B * calls - 1, -1, -1) for b, k in zip(blocks[c], kept[c]) if k]
    assert front == queue
    assert np.array_equal(np.asarray(got.release.now_free), (blocks > 0) & ~(to_front & ~kept))


def test_move_behind_puts_blocks_after_the_marked_ones_and_keeps_the_rest_in_order():
    # Queue 1..9; block 5 taken out (a hole); 2, 7 marked ahead; 8, 3 moved behind them, in that order.
    pool = free_queue.touch(free_queue.init_free_queue(10), jnp.array([5]))
    ahead = jnp.zeros(10, bool).at[jnp.array([2, 7])].set(True)
    moved = free_queue.move_behind(pool, ahead, jnp.array([8, 3, 0, 0], jnp.int32))
    assert free_queue.queue_order(moved) == [2, 7, 8, 3, 1, 4, 6, 9]
    assert int(moved.num_free) == 8
    # The positions agree with the queue: popping takes the head, and every block keeps its place.
    moved, ids = free_queue.pop_free(moved, jnp.int32(3), 4)
    assert ids.tolist()[:3] == [2, 7, 8] and free_queue.queue_order(moved) == [3, 1, 4, 6, 9]
    moved = free_queue.touch(moved, jnp.array([4]))
    assert free_queue.queue_order(moved) == [3, 1, 6, 9]
