"""The engine's vectorised allocator path against its per-request path, step by step, on random runs."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import semantic
from flax import nnx

from hkv_jax.allocator import prefix_cache
from hkv_jax.engine import Engine
from hkv_jax.engine import decode_batch as decode_batch_module
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM

# One model of three layer types: tiny-jamba's Mamba-2 layers (states spanning 2 pages under the
# min-waste policy) with a sliding-window layer and a full one; window-aware eviction on; a pool small
# enough to preempt and evict. Chunked local attention: the allocator's batched steps are checked on it
# (test_decode_step, test_prefill_batch) and the engine against the dense model (test_engine). Two
# engine compilations here; test_host_tier.py serves the model from a host tier.
HYBRID = {**resolve_model("tiny-jamba")[1], "sliding_window": 16,
          "layer_types": ["sliding_attention", "mamba", "full_attention", "mamba"]}
RUNS = {"sliding+mamba+full": (HYBRID, "min-waste", 40, True)}


def _engines(name: str, seed: int, kinds=({"vectorised": True}, {"vectorised": False})):
    """Engines of one model, one per keyword set of ``kinds``."""
    config, policy, blocks, early = RUNS[name]
    model = TinyLM(TinyConfig.from_hf(config), nnx.Rngs(seed))
    return [Engine(model, num_blocks=blocks, block_size=8, max_requests=4, max_model_len=128, token_budget=24,
                   impl="reference", policy=policy, seed=seed, window_aware_eviction=early, token_buckets=(24,),
                   **kind)
            for kind in kinds]


def _progress(engine: Engine) -> dict:
    """Each request's generated tokens and computed count, as ``Engine.requests`` shows them."""
    return {rid: (r.generated, r.computed, r.slot) for rid, r in engine.requests.items()}


# The tests of this file share their engines' compilations.
pytestmark = pytest.mark.xdist_group("engine-paths")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_vectorised_step_equals_the_per_request_step(name, monkeypatch):
    """Random multi-turn traffic (shared prefixes, chunked prefills, new requests while others decode,
    preemptions, sampling on and off): every step gives the same tokens, the same allocator state
    (queue order, ref counts, tables, counters, cache entries) and the same host queues on both paths.
    The vectorised engine also books decode-only steps with arrays; the per-request one never does."""
    rng = np.random.default_rng(len(name))
    monkeypatch.setattr(decode_batch_module, "MAX_PENDING", 3)  # decode tokens booked after 3 calls unread too
    fast, exact = _engines(name, seed=1)
    system = rng.integers(0, 256, 20).tolist()
    steps = preempted = 0
    for round_ in range(3):
        for e in (fast, exact):
            e.temperature = 0.9 if round_ == 1 else 0.0
        for _ in range(int(rng.integers(3, 6))):
            prompt = (system if rng.random() < 0.7 else []) + rng.integers(0, 256, int(rng.integers(1, 40))).tolist()
            new = int(rng.integers(1, 10))
            assert fast.add_request(prompt, new) == exact.add_request(prompt, new)
        while fast.has_work:
            got, want = fast.step(), exact.step()
            assert got == want, f"step {steps}"
            assert semantic(fast.state.alloc, fast.layout) == semantic(exact.state.alloc, exact.layout), f"step {steps}"
            assert (fast.running, fast.waiting, fast.scheduler.to_free) == (
                exact.running,
                exact.waiting,
                exact.scheduler.to_free,
            )
            steps += 1
            if steps % 5 == 0:  # the tokens booked with arrays, pending until the requests are read
                assert _progress(fast) == _progress(exact), f"step {steps}"
            if steps % 7 == 0 and len(fast.waiting) < 2:  # a request arrives while others decode
                prompt = system + rng.integers(0, 256, int(rng.integers(1, 30))).tolist()
                assert fast.add_request(prompt, 4) == exact.add_request(prompt, 4)
        assert not exact.has_work
        preempted = fast.stats.preemptions
    assert {rid: r.generated for rid, r in fast.requests.items()} == {
        rid: r.generated for rid, r in exact.requests.items()
    }
    assert steps > 30 and preempted > 0 and fast.stats.cache_hit_tokens > 0
    assert fast.stats.array_steps > 0 and exact.stats.array_steps == 0
    counters = ("steps", "tokens_computed", "prompt_tokens", "cache_hit_tokens", "generated", "preemptions")
    assert [getattr(fast.stats, c) for c in counters] == [getattr(exact.stats, c) for c in counters]
    assert [(r.computed, r.slot, r.cache_hit) for r in fast.requests.values()] == \
        [(r.computed, r.slot, r.cache_hit) for r in exact.requests.values()]
    # Everything freed on both paths.
    for e in (fast, exact):
        assert int(e.state.alloc.block_pool.free_queue.num_free) == e.layout.num_blocks - 1


def test_stop_tokens_end_requests_on_both_paths():
    """Sampled requests with stop tokens: each ends at its first stop token or at its token limit, on the
    vectorised path (which books decode-only steps with arrays) exactly as on the per-request path."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 12, 20, 3)]
    stop = tuple(range(0, 256, 7))
    fast, exact = _engines("sliding+mamba+full", seed=2)
    for e in (fast, exact):
        e.temperature = 1.0
        for p in prompts:
            e.add_request(p, 10, stop=stop)
    while fast.has_work:
        assert fast.step() == exact.step()
    assert not exact.has_work
    out = [r.generated for r in fast.requests.values()]
    assert out == [r.generated for r in exact.requests.values()]
    for toks in out:
        assert not set(toks[:-1]) & set(stop) and (toks[-1] in stop or len(toks) == 10)
    assert any(2 <= len(t) < 10 for t in out) and fast.stats.array_steps > 0


def test_multi_step_decoding_equals_single_steps():
    """``decode_steps=4``: a ``step()`` call runs up to 4 decode steps in one program. Against an engine
    stepping one at a time through the same traffic (more requests than lanes, two arriving mid-run, stop
    tokens, greedy then sampled, a pool small enough to preempt): the same tokens in the same order, the
    same allocator state and host queues after every call, and calls that ran several steps. The calls
    return arrays (``step_tokens``), and the requests read every fifth call (their pending tokens then
    booked) show what the single-step engine's show.

    In the second round the engine has ``max_call_seconds`` (1 s), and each call's rate is set before it
    (none timed yet, 0.5 or 0.25 s a step, or 0.25 s a step timed over one request: at most 1, 2, 4 or
    1 step for up to 4 requests): a call runs at most that many steps, some run exactly that, and decode
    calls time themselves."""
    rng = np.random.default_rng(11)
    multi, single = _engines("sliding+mamba+full", seed=8, kinds=({"decode_steps": 4}, {}))
    system = rng.integers(0, 256, 20).tolist()
    stop = (5, 77)

    def submit():
        prompt = system + rng.integers(0, 256, int(rng.integers(1, 30))).tolist()
        new = int(rng.integers(8, 40))
        assert multi.add_request(prompt, new, stop=stop) == single.add_request(prompt, new, stop=stop)

    calls, rates, most, timed, renumbered = 0, (None, (0.5, 4), (0.25, 4), (0.25, 1)), {}, 0, 0
    for round_ in range(2):
        for e in (multi, single):
            e.temperature = 0.9 if round_ == 1 else 0.0
        multi.max_call_seconds = 1.0 if round_ == 1 else None
        for _ in range(6):
            submit()
        while multi.has_work:
            multi.runner.step_seconds = rate = rates[calls % 4]
            steps, decoding, multi_calls = multi.stats.steps, len(multi.running), multi.stats.multi_step_calls
            if calls % 3 == 1:  # both clocks at the renumbering limit (years of inserts), their orders kept
                for e in (multi, single):
                    e.state = replace(e.state, alloc=_clock_at_limit(e.state.alloc))
            rids, tokens = multi.step_tokens()
            if calls % 3 == 1 and multi.stats.multi_step_calls > multi_calls:  # renumbered before its steps
                assert int(multi.state.alloc.block_pool.prefix_cache.clock) < prefix_cache.CLOCK_LIMIT
                renumbered += 1
            if round_ == 1:
                limit = 1 if rate is None else max(1, int(1.0 / (rate[0] * max(1, decoding / rate[1]))))
                assert multi.stats.steps - steps <= limit, f"call {calls}"
                most[limit] = max(most.get(limit, 0), multi.stats.steps - steps)
                timed += multi.runner.step_seconds != rate
            want = single.step()
            while single.stats.steps < multi.stats.steps:
                want += single.step()
            assert list(zip(rids.tolist(), tokens.tolist())) == want, f"call {calls}"
            assert single.stats.steps == multi.stats.steps
            assert semantic(multi.state.alloc, multi.layout) == semantic(single.state.alloc, single.layout)
            assert (multi.running, multi.waiting, multi.scheduler.to_free) == (
                single.running,
                single.waiting,
                single.scheduler.to_free,
            )
            if calls % 5 == 4:  # tokens booked with arrays wait until the requests are read: read them now
                assert _progress(multi) == _progress(single), f"call {calls}"
            calls += 1
            if calls in (6, 20):  # a request arrives while others decode
                submit()
        assert not single.has_work
    assert {rid: r.generated for rid, r in multi.requests.items()} == \
        {rid: r.generated for rid, r in single.requests.items()}
    assert multi.stats.multi_step_calls > 0 and calls < multi.stats.steps
    assert most == {1: 1, 2: 2, 4: 4} and timed > 0 and renumbered > 0


def _clock_at_limit(alloc):
    """``alloc``, its prefix cache's insertion clock at ``prefix_cache.CLOCK_LIMIT``: every time moved as much."""
    cache = alloc.block_pool.prefix_cache
    shift = prefix_cache.CLOCK_LIMIT - cache.clock
    cache = replace(cache, clock=cache.clock + shift,
                    cached_at=jnp.where(prefix_cache.is_cached(cache), cache.cached_at + shift, cache.cached_at))
    return replace(alloc, block_pool=replace(alloc.block_pool, prefix_cache=cache))


def test_a_plan_goes_to_the_device_once_and_again_when_it_changes():
    """Decode-only steps repeat their plan: it is packed and transferred once, not per step. A change of
    sampling between steps changes the plan, so it travels again and takes effect at once: from the
    switch on, the tokens equal the per-request engine's (which packs a plan every step) and part from a
    greedy engine's."""
    rng = np.random.default_rng(5)
    greedy, switched, exact = _engines("sliding+mamba+full", seed=4, kinds=({}, {}, {"vectorised": False}))
    for _ in range(3):
        prompt, = rng.integers(0, 256, (1, 6)).tolist()
        for e in (greedy, switched, exact):
            e.add_request(prompt, 30)
    for _ in range(3):  # the prefill, then decode-only steps
        assert greedy.step() == switched.step() == exact.step()
    sent = switched.stats.host_to_device_bytes
    for _ in range(4):
        assert greedy.step() == switched.step() == exact.step()
    assert switched.stats.host_to_device_bytes == sent  # nothing travelled: the device copy was reused
    switched.temperature = exact.temperature = 1.0
    after = [switched.step() for _ in range(6)]
    assert switched.stats.host_to_device_bytes > sent
    assert after == [exact.step() for _ in range(6)]
    assert after != [greedy.step() for _ in range(6)]
