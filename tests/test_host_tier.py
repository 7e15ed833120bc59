"""The host tier (``hkv_jax.allocator.host_tier``): hits served from host memory give the dense model's
tokens, each group keeps only what its hits need, and bad sizes are refused at start."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from test_engine import dense_greedy, tiny
from test_engine_paths import HYBRID

from hkv_jax.allocator import host_tier
from hkv_jax.allocator.free_queue import queue_order
from hkv_jax.engine import Engine, EngineConfig
from hkv_jax.models.tiny import TinyConfig, TinyLM

MAX_LEN = 128


def serve_one(eng: Engine, prompt: list[int], new: int) -> tuple[list[int], list[np.ndarray], int]:
    """Serve ``prompt`` alone: its tokens, their logits, and the host hit tokens it took."""
    hits = eng.host_usage().hit_tokens
    rid = eng.add_request(prompt, new)
    logits = []
    while eng.has_work:
        for r, _ in eng.step():
            logits.append(np.asarray(eng.last_output.logits[eng.last_rows[r]]))
    return eng.requests[rid].generated, logits, eng.host_usage().hit_tokens - hits


# One engine of the three kinds of group: a 16-token sliding window, Mamba-2 states (spanning 2 pages under
# min-waste) and full attention (test_engine_paths.HYBRID). A device pool of 43 blocks holds about one 70-token
# request of its groups (8-token blocks): serving four of them evicts the earlier ones, so the second round's
# hits come from the host. The second round repeats the prompts (the window, or state, before the prompt's end
# went down as it was computed; the release superseded it, but it stays until room is needed) and then
# continues the first conversation (the window before its end went down when it was released).
def test_hits_from_the_host_give_the_dense_models_tokens(tmp_path):
    model = TinyLM(TinyConfig.from_hf(HYBRID), nnx.Rngs(0))
    eng = Engine(model, num_blocks=44, block_size=8, max_requests=2, max_model_len=MAX_LEN, token_budget=32,
                 token_buckets=(32,), impl="reference", policy="min-waste", host_cache_bytes=1 << 20)
    assert {type(g.spec).__name__ for g in eng.layout.groups} == {"SlidingWindowSpec", "MambaSpec",
                                                                   "FullAttentionSpec"}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, 70)] for _ in range(4)]
    compiled = Engine.compilations()
    first = [serve_one(eng, p, 4) for p in prompts]
    assert eng.stats.cache_hit_tokens == 0
    down = eng.host_usage().blocks_down
    assert down > 0
    # Each release superseded the window (or state) before its prompt's end: a next turn hits at the
    # request's end. Those blocks wait right behind the empty host blocks, and still serve the repeats below.
    host, G = eng.state.host, eng.layout.num_groups
    superseded = np.flatnonzero(np.asarray(host.superseded)).tolist()
    assert eng.host_usage().superseded_blocks == len(superseded) > 0
    slot = np.asarray(host.pool.prefix_cache.block_slot)
    assert not any(eng.layout.groups[s % G].spec.keeps_every_token for s in slot[superseded])
    lru = queue_order(host.pool.free_queue)
    empty = sum(int(slot[b] < 0) for b in lru)
    assert empty > 0 and sorted(lru[empty:empty + len(superseded)]) == superseded
    again = [serve_one(eng, p, 4) for p in prompts]
    chat = prompts[0] + first[0][0] + [int(t) for t in rng.integers(0, 256, 20)]
    turn = serve_one(eng, chat, 4)
    served = sum(len(p) for p in prompts) + len(chat)
    host_hits = sum(h for _, _, h in again) + turn[2]
    assert host_hits >= 0.3 * served, (host_hits, served)
    assert turn[2] >= 64  # the conversation's 74 tokens, cut to its 8-token unit... and one block more: 72
    for prompt, (tokens, logits, _) in zip(prompts + prompts + [chat], first + again + [turn]):
        want, want_logits = dense_greedy(model, prompt, 4, MAX_LEN)
        assert tokens == want
        np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), atol=1e-4, rtol=1e-4)
    usage = eng.host_usage()
    assert usage.blocks_up > 0 and usage.bytes_up == usage.blocks_up * eng.block_bytes
    # Nothing leaks: every device block free, no host block held, each cached host block under one entry.
    assert int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1
    pool = eng.state.host.pool
    assert int(pool.free_queue.num_free) == usage.num_blocks
    assert not np.asarray(pool.free_queue.ref_count).any()
    assert sum(usage.cached_per_group) == int((np.asarray(pool.prefix_cache.block_slot) >= 0).sum())
    # Each group keeps what its hits need: every block of a full-attention group, fewer of the others.
    full = [g for g in range(eng.layout.num_groups) if eng.layout.groups[g].spec.keeps_every_token]
    other = [g for g in range(eng.layout.num_groups) if g not in full]
    assert max(usage.cached_per_group[g] for g in other) < min(usage.cached_per_group[g] for g in full)
    # A snapshot holds the host tier too: after a restore, or a save and load, the same request takes the
    # same host hits and gives the same tokens.
    snap = eng.snapshot()
    later = prompts[1] + again[1][0] + [int(t) for t in rng.integers(0, 256, 10)]
    then = serve_one(eng, later, 4), eng.host_usage()
    assert then[0][2] > 0
    eng.restore(snap)
    assert eng.host_usage() == usage
    assert (serve_one(eng, later, 4)[::2], eng.host_usage()) == (then[0][::2], then[1])
    eng.restore(snap)
    eng.save(tmp_path / "ckpt")
    serve_one(eng, prompts[2], 4)
    eng.load(tmp_path / "ckpt")
    assert eng.host_usage() == usage and serve_one(eng, later, 4)[::2] == then[0][::2]
    # Two step programs, the full and the lean one, each compiled once: the tier's arrays are committed to the
    # device from the start, as a release, a restore or a load leaves them.
    assert Engine.compilations() - compiled == 2


def test_host_tier_sizes_are_checked_at_start():
    model = tiny("tiny-gemma3")
    eng = Engine(model, num_blocks=44, block_size=8, max_model_len=MAX_LEN, host_cache_bytes=0)
    assert eng.state.host is None and eng.host_usage() is None  # 0: no tier, the engine as without one
    block = eng.block_bytes
    with pytest.raises(ValueError, match="needs one block of each of the 6 groups"):
        Engine(model, num_blocks=44, block_size=8, max_model_len=MAX_LEN, host_cache_bytes=5 * block)
    ok = Engine(model, num_blocks=44, block_size=8, max_model_len=MAX_LEN, host_cache_bytes=6 * block)
    assert ok.host_usage().num_blocks == 6
    with pytest.raises(ValueError, match="more than the .* bytes of host memory free"):
        Engine(model, num_blocks=44, block_size=8, max_model_len=MAX_LEN, host_cache_bytes=1 << 60)
    for bad in (-1, 1.5, "1GiB"):
        with pytest.raises(ValueError, match="host_cache_bytes must be a non-negative integer"):
            EngineConfig(num_blocks=44, host_cache_bytes=bad)
    with pytest.raises(ValueError, match="host_cache_supersede must be True or False"):
        EngineConfig(num_blocks=44, host_cache_supersede="no")
    with pytest.raises(ValueError, match="multiple of the scheduling unit"):
        Engine(model, num_blocks=44, block_size=8, max_model_len=MAX_LEN, host_cache_bytes=1 << 20,
               host_cache_unit=12)


def test_each_type_keeps_what_a_hit_on_a_unit_boundary_needs():
    # Blocks of 8 tokens, a host unit of 64 (8 blocks): full attention keeps every block; a 20-token window
    # the 3 blocks before each boundary; a 32-token chunk the chunk holding each boundary's end (it starts
    # at the boundary: none); a Mamba state the one at each boundary.
    from hkv_jax.allocator.managers import manager
    from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="float32")
    window = SlidingWindowSpec(num_kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    chunk = ChunkedLocalSpec(num_kv_heads=1, head_size=8, dtype="float32", attention_chunk_size=48)
    mamba = MambaSpec(shapes=((4,),), dtypes=("float32",))
    keep = {type(s).__name__: np.flatnonzero(manager(s).host_reachable(s, 8, 8, 16)).tolist()
            for s in (full, window, chunk, mamba)}
    assert keep == {"FullAttentionSpec": list(range(16)), "SlidingWindowSpec": [5, 6, 7, 13, 14, 15],
                    # boundary 64: chunk [48, 96) holds it: blocks 6, 7; boundary 128: chunk [96, 144): 12-15
                    "ChunkedLocalSpec": [6, 7, 12, 13, 14, 15], "MambaSpec": [7, 15]}
    assert host_tier.UNIT_WINDOWS >= 4


def test_a_release_supersedes_the_earlier_end_windows_of_its_prefix_unless_told_not_to():
    # Blocks of 4 tokens, a 6-token window (2 blocks), a host unit of 48 tokens (no multiple reached). An
    # 18-token prompt keeps the window before token 16 (blocks 2, 3); after 8 more tokens the release keeps
    # the window before token 24 (blocks 4, 5) and supersedes blocks 2 and 3 of the sliding group.
    from hkv_jax.allocator.kv_cache_manager import KVCacheManager
    from hkv_jax.planner import plan
    from hkv_jax.spec import FullAttentionSpec, SlidingWindowSpec

    cfg = plan([FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6)],
               block_size=4, num_blocks=40)
    for supersede in (True, False):
        m = KVCacheManager(cfg, max_model_len=64, max_requests=2, host_blocks=40, host_unit=48,
                           host_supersede=supersede)
        m.add("a", list(range(1, 19)))
        m.schedule("a", "all", 100)
        for t in range(101, 108):
            m.schedule("a", 1, t)
        m.free("a")
        superseded = np.flatnonzero(np.asarray(m.host.superseded)).tolist()
        slot = np.asarray(m.host.pool.prefix_cache.block_slot)
        lru = queue_order(m.host.pool.free_queue)
        empty = sum(int(slot[b] < 0) for b in lru)
        if supersede:
            assert len(superseded) == 2 and all(slot[b] % 2 == 1 for b in superseded)  # the sliding group's
            assert sorted(lru[empty:empty + 2]) == superseded  # first out, after the empty blocks
        else:
            assert superseded == [] and m.host.supersede is False
