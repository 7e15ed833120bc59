"""The jitted block pool against the plain-Python model's pool, and block hashing against its host twin."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv_jax.allocator import free_queue
from hkv_jax.allocator.hashing import block_hashes, np_block_hashes
from hkv_jax.allocator.pymodel import PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec

N = 12
MAXK = 6  # with N = 12 and HOLE_SLACK, pops see holes and the queue wraps and compacts
pop = jax.jit(functools.partial(free_queue.pop_free, slack=1), static_argnums=2)  # tiny slack: compaction happens
touch = jax.jit(free_queue.touch)
free = jax.jit(free_queue.free_ordered)


def model_pool(num_blocks):
    cfg = plan([FullAttentionSpec(name="l", num_kv_heads=1, head_size=8)], num_blocks=num_blocks)
    return PyAllocator(cfg, max_model_len=64)


def assert_same(pool, model):
    assert free_queue.queue_order(pool) == model.free_queue
    assert list(np.asarray(pool.ref_count)) == model.ref
    assert int(pool.num_free) == model.num_free_blocks


op = st.one_of(
    st.tuples(st.just("pop"), st.integers(0, MAXK)),
    st.tuples(st.just("touch"), st.lists(st.integers(1, N - 1), max_size=4, unique=True)),
    st.tuples(st.just("free"), st.lists(st.tuples(st.integers(1, N - 1), st.booleans()), max_size=6,
                                        unique_by=lambda x: x[0])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=25))
def test_pool_matches_the_model_queue_order(ops):
    pool, model = free_queue.init_free_queue(N), model_pool(N)
    assert_same(pool, model)
    for kind, arg in ops:
        if kind == "pop":
            if arg > model.num_free_blocks:
                continue
            pool, ids = pop(pool, jnp.int32(arg), MAXK)
            want = model._pop_free(arg)
            assert list(np.asarray(ids[:arg])) == want and not np.asarray(ids[arg:]).any()
        elif kind == "touch":
            pool = touch(pool, jnp.array(arg + [0] * (4 - len(arg)), jnp.int32))
            model._touch(arg)
        else:
            held = [(b, c) for b, c in arg if model.ref[b] > 0]
            cached = np.zeros(N, bool)
            for b, c in held:
                cached[b] = c or model.hash[b] is not None
                if c and model.hash[b] is None:
                    model.hash[b] = ("h", b)
                    model.cache[("h", b)] = [b]
            ids = [b for b, _ in held]
            flags = [bool(cached[b]) for b in ids] + [False] * (6 - len(ids))
            pool = free(pool, jnp.array(ids + [0] * (6 - len(ids)), jnp.int32), jnp.asarray(flags))
            model._free_blocks(ids)
        assert_same(pool, model)
        assert int(pool.ref_count[0]) == 0 and int(pool.pos[0]) == -1  # null block untouched


def test_snapshot_stays_valid_after_a_donated_update():
    pool = free_queue.init_free_queue(8)
    snap = pool
    popd = jax.jit(free_queue.pop_free, static_argnums=2, donate_argnums=0)
    new, ids = popd(jax.tree.map(jnp.copy, pool), jnp.int32(3), 4)
    assert list(np.asarray(ids)) == [1, 2, 3, 0]
    assert int(snap.num_free) == 7 and int(new.num_free) == 4


def test_hashes_match_the_host_twin_and_chain():
    rng = np.random.default_rng(0)
    toks = rng.integers(1, 32000, size=(3, 40)).astype(np.int32)
    salt = np.array([[7], [7], [9]], np.uint32)
    lora = np.array([[0], [0], [0]], np.uint32)
    got = np.asarray(jax.jit(functools.partial(block_hashes, block_size=8))(jnp.asarray(toks),
                                                                            first_extra=salt, extra=lora))
    for r in range(3):
        assert (got[r] == np_block_hashes(toks[r], 8, first_extra=salt[r], extra=lora[r])).all()
    assert got.shape == (3, 5, 4) and got.dtype == np.uint32
    # A different salt changes every block; the same tokens and salt give the same hashes.
    twin = np_block_hashes(toks[0], 8, first_extra=[7], extra=[0])
    assert (np_block_hashes(toks[0], 8, first_extra=[8], extra=[0]) != twin).any(axis=1).all()
    # Changing one token changes its block and every later one, never an earlier one.
    changed = toks[0].copy()
    changed[20] += 1
    other = np_block_hashes(changed, 8, first_extra=[7], extra=[0])
    assert (other[:2] == twin[:2]).all() and (other[2:] != twin[2:]).any(axis=1).all()
    # 128 bits spread: no two blocks of random data share any lane value.
    lanes = got.reshape(-1, 4)
    assert all(len(set(lanes[:, j])) == len(lanes) for j in range(4))


def test_queue_positions_stay_bounded_from_the_far_end_of_int32():
    """A pool whose queue ends sit just below 2^31 (as ever-growing positions would after days of
    serving) keeps vLLM's order through thousands of pops, hits and (batched) frees, and its positions
    come back into [0, N) at once and stay there."""
    n = 40
    lap = (2**31 - 1 - 2 * n) // n * n  # the same queue, read from an offset near int32's end
    pool = free_queue.init_free_queue(n)
    pool = dataclasses.replace(pool, head=pool.head + lap, tail=pool.tail + lap)
    model = model_pool(n)
    assert_same(pool, model)
    pop8 = jax.jit(free_queue.pop_free, static_argnums=2)
    calls = jax.jit(free_queue.free_calls)
    rng = np.random.default_rng(0)
    kinds = {"pop": 0, "touch": 0, "free": 0, "calls": 0}
    moved = False  # whether an operation moved the queue ends yet (a hit only punches a hole)
    for _ in range(3000):
        held = [b for b in range(1, n) if model.ref[b] > 0]
        kind = rng.choice(["pop", "pop", "touch", "free", "calls"])
        if kind == "pop":
            count = int(rng.integers(0, min(8, model.num_free_blocks) + 1))
            pool, ids = pop8(pool, jnp.int32(count), 8)
            assert list(np.asarray(ids[:count])) == model._pop_free(count)
        elif kind == "touch":  # hits: on free blocks (they leave the queue) or held ones (shared)
            blocks = [int(b) for b in rng.choice(np.arange(1, n), size=3, replace=False)]
            pool = touch(pool, jnp.array(blocks + [0], jnp.int32))
            model._touch(blocks)
        elif not held:
            continue
        else:
            # Several free calls, in order; a block shared by requests may be in more than one.
            rows = 1 if kind == "free" else 3
            ids = np.zeros((rows, 6), np.int32)
            cached = rng.random((rows, 6)) < 0.5
            for r in range(rows):
                picked = rng.choice(held, size=min(len(held), int(rng.integers(1, 7))), replace=False)
                picked = [b for b in picked if model.ref[b] > sum(b in ids[k] for k in range(r))]
                ids[r, :len(picked)] = picked
            for (r, i), b in np.ndenumerate(ids):
                if b and cached[r, i] and model.hash[b] is None:  # cache it: the model's side agrees
                    model.hash[b] = ("h", int(b))
                    model.cache[("h", int(b))] = [int(b)]
                cached[r, i] = bool(b) and model.hash[b] is not None
            pool = calls(pool, jnp.asarray(ids), jnp.asarray(cached))
            for r in range(rows):
                model._free_blocks([int(b) for b in ids[r] if b])
        kinds[str(kind)] += 1
        moved |= kind != "touch"
        assert_same(pool, model)
        head, tail = int(pool.head), int(pool.tail)
        assert head <= tail <= head + n and (0 <= head < n or not moved)
        free = np.asarray(pool.ref_count) == 0
        free[0] = False
        assert ((np.asarray(pool.pos)[free] >= 0) & (np.asarray(pool.pos)[free] < n)).all()
    assert min(kinds.values()) > 300
