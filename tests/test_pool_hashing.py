"""The jitted block pool against the plain-Python model's pool, and block hashing against its host twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv_jax.allocator import pool as P
from hkv_jax.allocator.hashing import block_hashes, np_block_hashes
from hkv_jax.allocator.pymodel import PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec

N = 12
MAXK = 6  # with N = 12 and HOLE_SLACK, pops see holes and the queue wraps and compacts
pop = jax.jit(functools.partial(P.pop_free, slack=1), static_argnums=2)  # tiny slack: compaction happens
touch = jax.jit(P.touch)
free = jax.jit(P.free_ordered)


def model_pool(num_blocks):
    cfg = plan([FullAttentionSpec(name="l", num_kv_heads=1, head_size=8)], num_blocks=num_blocks)
    return PyAllocator(cfg, max_model_len=64)


def assert_same(pool, model):
    assert P.queue_order(pool) == model.free_queue
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
    pool, model = P.init_pool(N), model_pool(N)
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
    pool = P.init_pool(8)
    snap = pool
    popd = jax.jit(P.pop_free, static_argnums=2, donate_argnums=0)
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
