"""The jitted prefix-cache table against a dict of (key, group) -> blocks, oldest first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv_jax.allocator import prefix_cache

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_prefix_cache")

NB = 10
KEYS = [np.array([k * 7919 % 13, k, 3 * k, 1], np.uint32) for k in range(6)]
insert = jax.jit(prefix_cache.insert)
evict = jax.jit(prefix_cache.evict)
lookup = jax.jit(prefix_cache.lookup)

op = st.one_of(
    # Few keys, so that blocks are often cached under a key that already has blocks (duplicates).
    st.tuples(st.just("insert"), st.integers(0, NB - 1), st.integers(0, 2), st.integers(0, 1)),
    st.tuples(st.just("evict"), st.integers(0, NB - 1), st.just(0), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=40), st.sampled_from([16, 32]))
def test_table_matches_the_dict_model(ops, slots):
    cache = prefix_cache.init_prefix_cache(NB, slots, num_groups=2)
    model: dict[tuple[int, int], list[int]] = {}
    where: dict[int, tuple[int, int]] = {}
    all_keys = jnp.asarray(np.stack([k for k in KEYS for _ in (0, 1)]))
    all_groups = jnp.asarray([g for _ in KEYS for g in (0, 1)], jnp.int32)
    for kind, b, k, g in ops:
        if kind == "insert":
            if b == 0 or b in where:
                continue
            cache = insert(cache, jnp.int32(b), jnp.asarray(KEYS[k]), jnp.int32(g))
            model.setdefault((k, g), []).append(b)
            where[b] = (k, g)
        elif kind == "evict":
            cache = evict(cache, jnp.int32(b))
            if b in where:
                key = where.pop(b)
                model[key].remove(b)
                if not model[key]:
                    del model[key]
        else:
            cache = prefix_cache.reset(cache)
            model.clear()
            where.clear()
        got = np.asarray(lookup(cache, all_keys, all_groups))
        want = [model.get((k, g), [0])[0] for k in range(len(KEYS)) for g in (0, 1)]
        assert list(got) == want
        cached = np.asarray(prefix_cache.is_cached(cache))
        assert [bool(cached[b]) for b in range(NB)] == [b in where for b in range(NB)]


def test_lookup_batches_and_misses_return_the_null_block():
    cache = prefix_cache.init_prefix_cache(8, num_groups=2)
    cache = insert(cache, jnp.int32(3), jnp.asarray(KEYS[1]), jnp.int32(0))
    got = lookup(cache, jnp.asarray(np.stack([KEYS[1], KEYS[1], KEYS[2]]))[None], jnp.array([[0, 1, 0]], jnp.int32))
    assert got.shape == (1, 3) and list(np.asarray(got[0])) == [3, 0, 0]


def test_evicting_the_oldest_duplicate_promotes_the_next_oldest():
    cache = prefix_cache.init_prefix_cache(10, 16, num_groups=2)
    for b in (2, 5, 7):
        cache = insert(cache, jnp.int32(b), jnp.asarray(KEYS[1]), jnp.int32(0))
    key, grp = jnp.asarray(KEYS[1])[None], jnp.array([0], jnp.int32)
    assert int(lookup(cache, key, grp)[0]) == 2
    cache = evict(cache, jnp.int32(5))  # a younger duplicate leaves: the head stays
    assert int(lookup(cache, key, grp)[0]) == 2
    cache = evict(cache, jnp.int32(2))
    assert int(lookup(cache, key, grp)[0]) == 7
    cache = evict(cache, jnp.int32(7))
    assert int(lookup(cache, key, grp)[0]) == 0


insert_many = jax.jit(prefix_cache.insert_many, static_argnames="claims")
evict_many = jax.jit(prefix_cache.evict_many)


def _apply_one_by_one(cache, batch, kind):
    for b, k, g in batch:
        if kind == "insert":
            cache = insert(cache, jnp.int32(b), jnp.asarray(KEYS[k]), jnp.int32(g))
        else:
            cache = evict(cache, jnp.int32(b))
    return cache


batch_op = st.tuples(st.sampled_from(["insert", "evict"]),
                     st.lists(st.tuples(st.integers(0, NB - 1), st.integers(0, 2), st.integers(0, 1)),
                              min_size=1, max_size=6))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch_op, min_size=1, max_size=12), st.sampled_from([16, 32]), st.randoms(use_true_random=False),
       st.sampled_from(["table", "sorted"]))
def test_batched_inserts_and_evictions_equal_one_by_one(batches, slots, rnd, claims):
    """Same lookups, cached set and duplicate order (checked by evicting everything one by one at the end)."""
    a = b = prefix_cache.init_prefix_cache(NB, slots, num_groups=2)
    cached: set[int] = set()
    all_keys = jnp.asarray(np.stack([k for k in KEYS for _ in (0, 1)]))
    all_groups = jnp.asarray([g for _ in KEYS for g in (0, 1)], jnp.int32)
    for kind, batch in batches:
        seen, clean = set(), []
        for blk, k, g in batch:  # distinct ids; inserts only of uncached blocks (the functions' contracts)
            if blk in seen or (kind == "insert" and blk in cached):
                continue
            seen.add(blk)
            clean.append((blk, k, g))
        if not clean:
            continue
        blocks = jnp.asarray([x[0] for x in clean], jnp.int32)
        if kind == "insert":
            a = insert_many(a, blocks, jnp.asarray(np.stack([KEYS[x[1]] for x in clean])),
                            jnp.asarray([x[2] for x in clean], jnp.int32), claims=claims)
            cached |= {x[0] for x in clean if x[0] > 0}
        else:
            a = evict_many(a, blocks)
            cached -= {x[0] for x in clean}
        b = _apply_one_by_one(b, clean, kind)
        assert (
            np.asarray(lookup(a, all_keys, all_groups)).tolist() == np.asarray(lookup(b, all_keys, all_groups)).tolist()
        )
        assert np.asarray(prefix_cache.is_cached(a)).tolist() == np.asarray(prefix_cache.is_cached(b)).tolist()
    order = sorted(cached)
    rnd.shuffle(order)
    for blk in order:
        a, b = evict(a, jnp.int32(blk)), evict(b, jnp.int32(blk))
        assert (
            np.asarray(lookup(a, all_keys, all_groups)).tolist() == np.asarray(lookup(b, all_keys, all_groups)).tolist()
        )


def test_a_large_batch_insert_equals_one_by_one_inserts():
    """4096 keys (the rounds narrow to 512 and then 64 lanes), half of them twice in the batch, some
    already cached, a few null blocks: same lookups and cached blocks as one insert at a time, and the
    same duplicate order (the same lookups again after evicting a random half)."""
    rng = np.random.default_rng(0)
    num_blocks, k = 6000, 4096
    pool = rng.integers(0, 2**32, (k // 2, 4), dtype=np.uint32)
    keys = jnp.asarray(pool[rng.integers(0, len(pool), k)])
    groups = jnp.asarray(rng.integers(0, 2, k), jnp.int32)
    ids = rng.permutation(np.arange(1, num_blocks))
    blocks = jnp.asarray(np.where(rng.random(k) < 0.02, 0, ids[:k]), jnp.int32)
    early = jnp.asarray(ids[k:k + 300], jnp.int32)  # cached before the batch, under keys of the batch

    def one_by_one(cache, blocks, keys, groups):
        return jax.lax.fori_loop(
            0, blocks.shape[0], lambda i, c: prefix_cache.insert(c, blocks[i], keys[i], groups[i]), cache
        )

    start = jax.jit(one_by_one)(
        prefix_cache.init_prefix_cache(num_blocks, num_groups=2), early, keys[:300], groups[:300]
    )
    a = insert_many(start, blocks, keys, groups, claims="table")
    b = jax.jit(one_by_one)(start, blocks, keys, groups)
    gone = jnp.asarray(rng.permutation(np.concatenate([ids[:k], ids[k:k + 300]]))[: k // 2], jnp.int32)
    for _ in range(2):
        assert np.asarray(lookup(a, keys, groups)).tolist() == np.asarray(lookup(b, keys, groups)).tolist()
        assert np.asarray(prefix_cache.is_cached(a)).tolist() == np.asarray(prefix_cache.is_cached(b)).tolist()
        a, b = evict_many(a, gone), evict_many(b, gone)


@pytest.mark.parametrize("claims", ["table", "sorted"])
def test_inserting_rows_equals_one_by_one_inserts_in_row_order(claims):
    """Rows of 3 groups: some hashes twice in the batch, some with entries cached before it, null blocks
    here and there, and a batch of new hashes only (rows on slots of their own): same lookups, cached
    blocks and duplicate order as inserting every block alone, row by row."""
    rng = np.random.default_rng(1)
    num_blocks, k, G = 3000, 512, 3
    pool = rng.integers(0, 2**32, (k * 3 // 4, 4), dtype=np.uint32)
    ids = rng.permutation(np.arange(1, num_blocks))

    def one_by_one(cache, blocks, keys):
        def row(i, c):
            return jax.lax.fori_loop(0, G, lambda g, c: prefix_cache.insert(c, blocks[i, g], keys[i], g), c)
        return jax.lax.fori_loop(0, blocks.shape[0], row, cache)

    early_keys = jnp.asarray(pool[:100])
    early = jnp.asarray(np.where(rng.random((100, G)) < 0.5, ids[:100 * G].reshape(100, G), 0), jnp.int32)
    start = jax.jit(one_by_one)(prefix_cache.init_prefix_cache(num_blocks, num_groups=G), early, early_keys)
    rest = ids[100 * G:]
    fresh = rng.integers(0, 2**32, (k // 4, 4), dtype=np.uint32)
    batches = [(pool[rng.integers(0, len(pool), k)], rng.random((k, G)) < 0.1),  # shared slots
               (fresh, np.zeros((k // 4, G), bool))]                            # own slots only
    everything = np.concatenate([pool, fresh])
    groups = jnp.asarray(np.tile(np.arange(G), len(everything)), jnp.int32)
    all_keys = jnp.asarray(np.repeat(everything, G, axis=0))
    a = b = start
    for keys, null in batches:
        n = keys.shape[0] * G
        blocks = jnp.asarray(np.where(null, 0, rest[:n].reshape(-1, G)), jnp.int32)
        rest = rest[n:]
        a = jax.jit(prefix_cache.insert_rows, static_argnames="claims")(a, blocks, jnp.asarray(keys), claims=claims)
        b = jax.jit(one_by_one)(b, blocks, jnp.asarray(keys))
        assert np.asarray(lookup(a, all_keys, groups)).tolist() == np.asarray(lookup(b, all_keys, groups)).tolist()
        assert np.asarray(prefix_cache.is_cached(a)).tolist() == np.asarray(prefix_cache.is_cached(b)).tolist()
    gone = jnp.asarray(rng.permutation(np.flatnonzero(np.asarray(prefix_cache.is_cached(a))))[:800], jnp.int32)
    a, b = evict_many(a, gone), evict_many(b, gone)
    assert np.asarray(lookup(a, all_keys, groups)).tolist() == np.asarray(lookup(b, all_keys, groups)).tolist()


def test_insertion_clock_is_renumbered_before_int32_ends():
    """Duplicates under one key are served oldest first by their insertion times. A cache whose clock
    nears 2^31 (years of inserts) would wrap and take the newest block for the oldest; ``new_step``
    renumbers the times first, in their order, so the oldest still takes over."""
    from dataclasses import replace

    from hkv_jax.allocator import ops
    from hkv_jax.allocator.state import Layout, init_state
    from hkv_jax.planner import plan
    from hkv_jax.spec import FullAttentionSpec

    cfg = plan([FullAttentionSpec(name="f", num_kv_heads=1, head_size=8)], block_size=4, num_blocks=NB)
    layout = Layout.from_config(cfg, max_model_len=16, max_requests=1)
    key, group = jnp.asarray(KEYS[0]), jnp.int32(0)
    cache = init_state(layout).block_pool.prefix_cache
    for b in (1, 2):
        cache = insert(cache, jnp.int32(b), key, group)
    start = 2**31 - 2  # block 1 cached at start - 2, block 2 at start - 1
    cache = replace(cache, clock=jnp.int32(start), cached_at=cache.cached_at.at[jnp.array([1, 2])].set(
        jnp.array([start - 2, start - 1], jnp.int32)))

    def third_after(cache):
        for b in (3, 4, 5):  # the clock passes 2^31 - 1 here
            cache = insert(cache, jnp.int32(b), key, group)
        cache = evict(cache, jnp.int32(1))  # the oldest leaves: the next oldest (2) takes over
        return int(lookup(cache, key[None], group[None])[0])

    assert third_after(cache) != 2  # without renumbering: the wrapped clock makes a newer block "oldest"
    st = jax.jit(ops.new_step, static_argnums=0)(layout, replace(init_state(layout), block_pool=replace(
        init_state(layout).block_pool, prefix_cache=cache)))
    assert int(st.block_pool.prefix_cache.clock) == 2 and np.asarray(st.block_pool.prefix_cache.cached_at)[
        [1, 2]
    ].tolist() == [0, 1]
    assert third_after(st.block_pool.prefix_cache) == 2
