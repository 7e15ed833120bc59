"""The jitted allocator's promises beyond conformance: failure takes nothing, snapshots stay valid."""


import jax
import numpy as np
import pytest

from hkv_jax.allocator.kv_cache_manager import KVCacheManager
from hkv_jax.allocator.pymodel import PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_allocator_jax")

LAYERS = [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
          SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=8)]


def manager(num_blocks=12, donate=False, layers=LAYERS):
    return KVCacheManager(plan(layers, block_size=4, policy="vllm", num_blocks=num_blocks), max_model_len=64,
                          max_requests=4, donate=donate)


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_failed_first_schedule_changes_nothing():
    m = manager()
    m.add("a", list(range(1, 21)))
    assert m.schedule("a", "all", 7)["ok"]
    m.free("a")  # its blocks stay cached in the free queue
    m.add("big", list(range(1, 21)) + list(range(100, 140)))
    before = leaves(m.state)
    res = m.schedule("big", "all", 1)
    assert res["ok"] is False and res["cache_hit_tokens"] == 20
    assert all((x == y).all() for x, y in zip(before, leaves(m.state)))


def test_failed_running_schedule_only_releases_out_of_window_blocks():
    m = manager(num_blocks=16)
    m.add("a", list(range(1, 9)))
    res = m.schedule("a", "all", None)
    slot = m._slots["a"]
    while res["ok"]:  # grow by 8 tokens a call until the pool runs dry
        for t in range(8):
            m.append_token("a", 50 + t)
        before = m.state
        res = m.schedule("a", "all", None)
    freed = int(m.state.block_pool.free_queue.num_free) - int(before.block_pool.free_queue.num_free)
    assert freed == 2  # the two sliding-window blocks that left the window since the last call
    tb, ta = np.asarray(before.tables), np.asarray(m.state.tables)
    changed = tb != ta
    assert changed.sum() == freed and (ta[changed] == 0).all() and changed[:, 1].sum() == freed
    assert int(m.state.num_computed[slot]) == int(before.num_computed[slot])
    same = ["status", "tokens", "num_tokens", "hashes", "num_computed", "table_len", "num_cached", "step_cached"]
    assert all((np.asarray(getattr(before, f)) == np.asarray(getattr(m.state, f))).all() for f in same)
    assert all(
        (np.asarray(x) == np.asarray(y)).all()
        for x, y in zip(
            jax.tree.leaves(before.block_pool.prefix_cache), jax.tree.leaves(m.state.block_pool.prefix_cache)
        )
    )


@pytest.mark.parametrize("donate", [False, True])
def test_snapshot_and_rollback_are_exact(donate):
    m = manager(donate=donate)
    m.add("a", list(range(1, 30)))
    assert m.schedule("a", 12, None)["ok"]
    snap = m.snapshot()
    first = [m.schedule("a", 8, None), m.schedule("a", "all", 3), m.schedule("a", 1, None)]
    after = leaves(m.state)
    m.restore(snap)
    again = [m.schedule("a", 8, None), m.schedule("a", "all", 3), m.schedule("a", 1, None)]
    assert first == again
    assert all((x == y).all() for x, y in zip(after, leaves(m.state)))
    # The snapshot itself is still readable after donated calls.
    assert int(snap[0].num_computed[snap[1]["a"]]) == 12


def test_bad_input_raises_and_keeps_state():
    m = manager()
    with pytest.raises(ValueError, match="unknown request"):
        m.schedule("ghost")
    with pytest.raises(ValueError, match="prompt"):
        m.add("x", [])
    m.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match="exists"):
        m.add("a", [1])
    with pytest.raises(ValueError, match="not running"):
        m.preempt("a")
    with pytest.raises(ValueError, match="num_tokens"):
        m.schedule("a", 0)
    assert m.schedule("a", "all", 4)["ok"]


def test_a_spanning_mamba_state_takes_its_pages_together():
    """Under min-waste a 384-byte state spans three 128-byte pages: every state entry is three distinct
    pages, taken, cached, hit and released together; the plain-Python model agrees on every result."""
    layers = [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              MambaSpec(name="m", shapes=[[2, 48]], dtypes=["float32"])]
    cfg = plan(layers, block_size=4, policy="min-waste", num_blocks=16)
    assert cfg.page_size_bytes == 128 and cfg.groups[1].blocks_per_state == 3
    jx, py = KVCacheManager(cfg, max_model_len=32, max_requests=2), PyAllocator(cfg, max_model_len=32)

    def both(op, *args):
        a, b = getattr(jx, op)(*args), getattr(py, op)(*args)
        assert a == b
        assert jx.num_free_blocks == py.num_free_blocks
        return a

    prompt = list(range(1, 11))
    both("add", "a", prompt)
    both("schedule", "a", 8, None)     # the state after 8 tokens: entry 1, cached once full
    both("new_step")
    r = both("schedule", "a", "all", 99)
    states = np.reshape(r["block_table"][1], (-1, 3))
    live = states[states[:, 0] > 0]
    assert len(live) == 2 and (live > 0).all() and len(set(live.ravel())) == 6  # old and new state
    assert jx.num_free_blocks == 15 - len(r["block_table"][0]) - 6
    both("free", "a")
    both("add", "b", prompt[:8] + [50, 51, 52])
    r = both("schedule", "b", "all", None)
    assert r["cache_hit_tokens"] == 8
    hit = np.reshape(r["hit_block_ids"][1], (-1, 3))
    assert (hit[1] > 0).all() and len(set(hit[1])) == 3  # the cached state, all three pages
    # Per-group tables of no request at all (the engine's report once every request is done).
    M = jx.layout.max_blocks
    assert [t.shape for t in jx.layout.config_tables(np.zeros((0, 4, M)))] == [(0, M), (0, 3 * M)]


@pytest.mark.parametrize("aware", [False, True])
def test_window_aware_eviction_sends_out_of_window_blocks_to_the_queue_front(aware):
    from hkv_jax.allocator.free_queue import queue_order

    m = KVCacheManager(plan(LAYERS, block_size=4, policy="vllm", num_blocks=40), max_model_len=64, max_requests=4,
                       window_aware_eviction=aware)
    m.add("a", list(range(1, 23)))
    assert m.schedule("a", "all", 7)["ok"]  # 22 tokens: 6 blocks per group
    sliding = np.asarray(m.state.tables[m._slots["a"], 1])
    assert m.schedule("a", 1, None)["ok"]  # releases sliding blocks 0-2 (window 8), takes no new block
    out_of_window = [int(b) for b in sliding[:3][::-1]]  # freed last block first
    queue = queue_order(m.state.block_pool.free_queue)
    cached = np.asarray(m.state.block_pool.prefix_cache.block_slot)
    assert all(cached[b] >= 0 for b in out_of_window)  # still cached either way: a hit may still take them
    if aware:
        assert queue[:3] == out_of_window  # evicted first
    else:
        assert queue[-3:] == out_of_window and queue[:3] != out_of_window  # LRU tail


@pytest.mark.parametrize("G", [1, 3])
def test_counters_write_only_their_columns(G):
    import jax.numpy as jnp

    from hkv_jax.allocator.state import GROUP_COUNTERS, REQUEST_COUNTERS, counter, set_counters

    R = 5
    counts = jnp.arange(R * (3 + 4 * G), dtype=jnp.int32).reshape(R, -1)
    want = {name: np.asarray(counter(counts, name)).copy() for name in REQUEST_COUNTERS + GROUP_COUNTERS}
    slots = jnp.array([3, 1])
    out = set_counters(counts, slots, status=7, num_cached=jnp.full((2, G), 9), last_state=jnp.array([[4], [5]]))
    out = set_counters(out, 0, G - 1, retired=-2)  # one group's column of one slot
    want["status"][[3, 1]] = 7
    want["num_cached"][[3, 1]] = 9
    want["last_state"][3], want["last_state"][1] = 4, 5
    want["retired"][0, G - 1] = -2
    for name, w in want.items():
        assert counter(out, name).shape == w.shape
        assert np.array_equal(np.asarray(counter(out, name)), w), name
    # A per-request value for a group counter would broadcast along the groups axis: refused.
    with pytest.raises(ValueError, match="one value per group"):
        set_counters(counts, slots, table_len=jnp.array([1, 2]))
    with pytest.raises(KeyError, match="unknown counter"):
        set_counters(counts, slots, tables=1)
