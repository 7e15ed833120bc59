"""The serving engine against the dense, uncached model; snapshots, forks and checkpoints."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv_jax.cache import read_mamba_state
from hkv_jax.engine import Engine, NgramSpec, sample
from hkv_jax.models.key_centre import KeyCentre, calibrate_key_centres, calibration_ids
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM

MAX_LEN = 80  # the workload's longest request: 76 tokens
# Pools small enough that the parity workload preempts (the groups differ per model), per (model, planner
# policy); every parity run caches prefixes. Without prefix caching (a preempted request comes back under a
# new cache salt): Gemma 3 270M's parity test (test_gemma3.py) serves it, with preemptions.
# tiny-jamba runs under min-waste: each Mamba state spans 2 pages (the vllm policy's one-page states run
# without caching here, and in every replay trace). tiny-gemma4 runs under both: vllm gives its full-attention
# groups 16 tokens per block and its sliding ones 8 (hits on 16-token boundaries); min-waste packs two
# full-attention layers in one page slot, every group at 8. Its KV-sharing layers read other layers' pages.
PARITY_BLOCKS = {("tiny-gemma3", "vllm"): 44, ("tiny-gptoss", "vllm"): 14, ("tiny-llama4", "vllm"): 26,
                 ("tiny-jamba", "min-waste"): 28, ("tiny-gemma4", "vllm"): 48, ("tiny-gemma4", "min-waste"): 48}
# Generated tokens per request: tiny-llama4 preempts in the smallest pool that holds one request only
# with 8 (its chunked-local groups hold few blocks), tiny-gemma4 with 10.
NEW_TOKENS = {"tiny-llama4": 8, "tiny-gemma4": 10}
# tiny-gptoss (2 groups: the cheapest to compile) runs the default token buckets: decode-only steps run the
# step compiled for 4 tokens, and its tokens are checked against the dense model too (without drafts).
DEFAULT_BUCKETS = {"tiny-gptoss"}
# tiny-gptoss runs the portable Pallas kernels (the GPU path's code) in interpret mode; the others run the
# dense jnp reference attention.
IMPL = {"tiny-gptoss": "triton_interpret"}
# tiny-llama4's engines report the 3 likeliest tokens of every row (``max_top_logprobs``) and carry 4
# logit-bias entries per request (``max_logit_bias``): its parity run carries the extra report rows and
# plan words, and the log-probability and logit-bias tests share its compile.
MAX_TOP_LOGPROBS = {"tiny-llama4": 3}
MAX_LOGIT_BIAS = {"tiny-llama4": 4}


def tiny(name: str, seed: int = 0, kv_dtype: str = "float32") -> TinyLM:
    return TinyLM(TinyConfig.from_hf(resolve_model(name)[1], kv_dtype=kv_dtype), nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnums=0)
def _dense(graph: nnx.GraphDef, weights: nnx.State, tokens: jax.Array) -> jax.Array:
    return nnx.merge(graph, weights).dense(tokens)


def dense_greedy(model: TinyLM, prompt: list[int], n: int,
                 max_len: int = MAX_LEN) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and their logits from the uncached model (padded to ``max_len`` tokens, the weights an
    argument: one compile per model shape and length, shared by a test's prompts)."""
    graph, weights = nnx.split(model)
    toks, logits = list(prompt), []
    for _ in range(n):
        row = np.asarray(_dense(graph, weights, jnp.asarray(toks + [0] * (max_len - len(toks))))[len(toks) - 1])
        logits.append(row)
        toks.append(int(row.argmax()))
    return toks[len(prompt):], logits


def workload(seed: int = 0, vocab: int = 256):
    """Four prompts sharing a 40-token system prompt (cache hits), one long (chunked prefill)."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, vocab, 40)]
    return [system + [int(t) for t in rng.integers(0, vocab, k)] for k in (5, 12, 30, 3)]


# Engines of the same sizes on one worker compile once: tiny-gemma3's parity engine and the fork test's;
# tiny-llama4's and the rollback and checkpoint tests'; tiny-jamba's and the Mamba state test's. A speculative
# parity engine runs the plain steps of its non-speculative twin (the same sizes, on the reference attention)
# and compiles only its drafting step after it: each pair runs in one group (tiny-gemma4's under vllm).
SAME_SIZES = {name: pytest.mark.xdist_group(f"{name}-parity-sizes")
              for name in ("tiny-gemma3", "tiny-llama4", "tiny-jamba", "tiny-gemma4")}
GROUPED = {("tiny-gemma3", "vllm"), ("tiny-llama4", "vllm"), ("tiny-jamba", "min-waste"), ("tiny-gemma4", "vllm")}


# Speculative decoding (n-gram drafts of 3 tokens): the same tokens and logits, with the drafts' slots taken
# from the same small pool, on the tiny models whose groups the other tests speculate on least: tiny-jamba (its
# Mamba states rewound to the accepted token), tiny-llama4 (chunked local attention) and tiny-gemma4 (KV
# sharing, two block sizes). Sliding window + full speculate in test_speculative.py (tiny-gemma3, against the
# engine without drafts) and in test_gemma3.py (Gemma 3 270M, against transformers).
SPECULATIVE = {("tiny-llama4", "vllm"), ("tiny-gemma4", "vllm"), ("tiny-jamba", "min-waste")}


# fp8 pages (e4m3): tiny-gemma3 (sliding window + full) stores its K/V in float8_e4m3fn, its keys centred
# (``key_centre``, calibrated); the dense model reads them centred and rounded the same way (``Attention.dense``).
@pytest.mark.parametrize("name,policy,speculative,kv_dtype", [
    pytest.param(name, policy, spec, "float32", marks=[SAME_SIZES[name]] if (name, policy) in GROUPED else [],
                 id=f"{name}-{policy}-{spec}")
    for name, policy in sorted(PARITY_BLOCKS) for spec in (False, True) if not spec or (name, policy) in SPECULATIVE
] + [pytest.param("tiny-gemma3", "vllm", False, "float8_e4m3fn", id="tiny-gemma3-vllm-fp8")])
def test_engine_generates_the_dense_models_tokens(name, policy, speculative, kv_dtype):
    model = tiny(name, kv_dtype=kv_dtype)  # the dense oracle reads K/V rounded to kv_dtype
    # The engine serves the float32 model with EngineConfig.kv_cache_dtype (the same weights).
    served, cache_dtype = (model, "auto") if kv_dtype == "float32" else (tiny(name), "fp8")
    if kv_dtype != "float32":  # the oracle takes the served model's centres
        calibrate_key_centres(served, calibration_ids(None), MAX_LEN)
        nnx.update(model, nnx.state(served, KeyCentre))
        assert all(np.abs(np.asarray(c)).max() > 0.05 for c in jax.tree.leaves(nnx.state(model, KeyCentre)))
    # A pool small enough that the run preempts; a token budget that chunks the prefills.
    eng = Engine(served, num_blocks=PARITY_BLOCKS[name, policy], block_size=8, max_requests=4,
                 max_model_len=MAX_LEN, token_budget=32, kv_cache_dtype=cache_dtype,
                 token_buckets=None if name in DEFAULT_BUCKETS and not speculative else (32,),
                 impl="reference" if speculative else IMPL.get(name, "reference"), policy=policy,
                 max_top_logprobs=MAX_TOP_LOGPROBS.get(name, 0),
                 max_logit_bias=MAX_LOGIT_BIAS.get(name, 0), speculative=NgramSpec(3) if speculative else None)
    if name == "tiny-gemma4":  # what the two policies plan for it
        groups = eng.kv_cache_config.groups
        assert {g.block_size for g in groups} == ({8} if policy == "min-waste" else {8, 16})
        assert {g.layers_per_slot for g in groups} == ({1, 2} if policy == "min-waste" else {1})
    prompts = workload()
    new = NEW_TOKENS.get(name, 6)
    if kv_dtype != "float32":  # the rounding shows: the same weights' logits over unrounded K/V differ
        assert {g.spec.dtype for g in eng.kv_cache_config.groups} == {kv_dtype}
        plain = jax.jit(served.dense)(jnp.asarray(prompts[0]))
        assert np.abs(np.asarray(plain) - np.asarray(jax.jit(model.dense)(jnp.asarray(prompts[0])))).max() > 1e-3
    ids = [eng.add_request(p, new) for p in prompts]
    logits = {rid: [] for rid in ids}
    while eng.has_work:
        emitted = collections.Counter()
        for rid, _ in eng.step():  # each token's logits row stays on the device until read here
            row = eng.last_output.logits[eng.last_rows[rid]]  # a speculative step's: one per emitted position
            logits[rid].append(np.asarray(row if row.ndim == 1 else row[emitted[rid]]))
            emitted[rid] += 1
    out = {rid: r.generated for rid, r in eng.requests.items()}
    ran = {k.removeprefix("speculative ") for k in eng.stats.bucket_steps}
    assert {str(s.token_budget) for s in eng.statics} <= ran  # every bucket ran
    if speculative:  # drafts were verified and accepted (rejections: test_speculative_decoding_...)
        assert eng.stats.spec_accepted_tokens > 0
    else:
        assert any(k.startswith("lean") for k in eng.stats.bucket_steps) and eng.stats.lean_misses == 0
    assert eng.stats.preemptions >= 1
    assert eng.stats.cache_hit_tokens > 0
    assert eng.stats.device_to_host == eng.stats.steps  # one report read per step
    # Over fp8 pages the engine's keys and the dense model's differ in their last float32 bits (batched and
    # whole-sequence matmuls), so a key at an e4m3 rounding midpoint may round one step apart: 4e-4 seen.
    tol = 1e-4 if kv_dtype == "float32" else 1e-3
    for rid, p in zip(ids, prompts):
        want, want_logits = dense_greedy(model, p, new)
        assert out[rid] == want, f"request {rid}"
        np.testing.assert_allclose(np.stack(logits[rid]), np.stack(want_logits), atol=tol, rtol=tol,
                                   err_msg=f"request {rid}")
    # Everything freed: every block is back in the free queue, no ref count left.
    assert int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1
    assert not np.asarray(eng.state.alloc.block_pool.free_queue.ref_count).any()
    # No recompilation per step: the same workload again compiles nothing new.
    compiled = Engine.compilations()
    for p in prompts:
        eng.add_request(p, new)
    eng.run()
    assert Engine.compilations() == compiled


@SAME_SIZES["tiny-gemma3"]
def test_without_prefix_caching_nothing_hits_and_the_tokens_stay_the_dense_models():
    """``prefix_caching=False`` (a cache salt per admission, on the host: tiny-gemma3's parity engine and its
    programs): the shared system prompt never hits, every prompt token is computed, and every request gets
    the dense model's tokens."""
    model = tiny("tiny-gemma3")
    eng = Engine(model, num_blocks=PARITY_BLOCKS["tiny-gemma3", "vllm"], block_size=8, max_requests=4,
                 max_model_len=MAX_LEN, token_budget=32, token_buckets=(32,), impl="reference", policy="vllm",
                 prefix_caching=False)
    prompts = workload()
    ids = [eng.add_request(p, 6) for p in prompts]
    out = eng.run()
    assert eng.stats.cache_hit_tokens == 0
    assert eng.stats.tokens_computed == sum(map(len, prompts)) + len(prompts) * 5  # the last token is not fed back
    for rid, p in zip(ids, prompts):
        assert out[rid] == dense_greedy(model, p, 6)[0], f"request {rid}"
    assert int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1


@SAME_SIZES["tiny-jamba"]
def test_mamba_state_blocks_hold_the_dense_states_and_serve_hits():
    """Every Mamba table entry holds the dense model's state after the tokens it stands for (the state
    after ``(i + 1) * block_size`` tokens once full), also when a chunk starts inside a block; a later
    request hits the cached state and its logits equal the dense model's. Each state spans 2 pages."""
    model = tiny("tiny-jamba")
    key = "tiny-jamba", "min-waste"
    eng = Engine(
        model,
        num_blocks=PARITY_BLOCKS[key],
        block_size=8,
        max_requests=4,
        max_model_len=MAX_LEN,
        token_budget=32,
        token_buckets=(32,),
        impl="reference",
        policy=key[1],
    )  # the parity test's compile
    bs = eng.layout.block_sizes[0]
    k = {len(p) for p in eng.layout.parts if eng.layout.is_mamba(p[0])}
    assert k == {2}
    prompts = workload()
    rid = eng.add_request(prompts[0], 12)
    eng.requests[rid].max_chunk = 20  # chunks 0..20, then 20..24 (stopped at the block boundary), ...
    mamba = [(g, eng.kv_cache_config.groups[g].layer_names[0]) for g, p in enumerate(eng.layout.parts)
             if eng.layout.is_mamba(p[0])]
    dense_states = jax.jit(model.dense_states)
    dense = {}
    checked, ends = 0, []
    while eng.has_work:
        eng.step()
        r = eng.requests[rid]
        if r.slot < 0:
            break
        ends.append(r.computed)
        toks = r.prompt + r.generated
        alloc = eng.state.alloc
        tables = eng.layout.config_tables(np.asarray(alloc.tables[r.slot]))
        for g, layer in mamba:
            length = int(alloc.table_len[r.slot, eng.layout.parts[g][0]])
            entries = tables[g].reshape(-1, 2)[:length]              # the 2 pages of each state
            for i in np.nonzero(entries[:, 0])[0]:
                assert entries[i].all() and entries[i, 0] != entries[i, 1]
                n = min((i + 1) * bs, r.computed)
                if n not in dense:
                    dense[n] = dense_states(jnp.asarray(toks + [0] * (MAX_LEN - len(toks))), n)
                got = read_mamba_state(eng.state.cache, layer, jnp.asarray(entries[i:i + 1]))
                for a, b in zip(got, dense[n][layer]):
                    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b), atol=1e-4, rtol=1e-4)
                checked += 1
    assert bs == 8 and ends[:3] == [20, 24, 44] and checked > 20
    # A second request shares the first 40 tokens: it hits the state cached after 24 of them (the last
    # chunk that ended on a block boundary within them).
    prompt = prompts[0][:40] + prompts[1][40:]
    second = eng.add_request(prompt, 3)
    logits = []
    while eng.has_work:
        if eng.step():
            logits.append(np.asarray(eng.last_output.logits[0]))
    assert eng.requests[second].cache_hit == 24
    _, want = dense_greedy(model, prompt, 3)
    np.testing.assert_allclose(np.stack(logits), np.stack(want), atol=1e-4, rtol=1e-4)


def run_tokens(eng: Engine) -> dict[int, list[int]]:
    return {rid: list(toks) for rid, toks in eng.run().items()}


def llama4_engine(seed: int, **kwargs) -> Engine:
    """tiny-llama4 at its parity test's sizes (``SAME_SIZES``: one compile for the tests of its group)."""
    kwargs = {"max_top_logprobs": MAX_TOP_LOGPROBS["tiny-llama4"], "max_logit_bias": MAX_LOGIT_BIAS["tiny-llama4"],
              **kwargs}
    return Engine(tiny("tiny-llama4"), num_blocks=PARITY_BLOCKS["tiny-llama4", "vllm"], block_size=8,
                  max_requests=4, max_model_len=MAX_LEN, token_budget=32, token_buckets=(32,), impl="reference",
                  seed=seed, **kwargs)


@SAME_SIZES["tiny-llama4"]
def test_rollback_restores_generation_bit_exactly():
    eng = llama4_engine(seed=3)
    eng.temperature, eng.top_p = 1.0, 0.9  # sampling: the PRNG key is part of the snapshot
    for p in workload(1)[:3]:
        eng.add_request(p, 8)
    for _ in range(4):
        eng.step()
    snap = eng.snapshot()
    first = run_tokens(eng)
    eng.restore(snap)
    second = run_tokens(eng)
    assert first == second
    eng.restore(snap)  # the snapshot survives a restore (the step donates only copies)
    assert run_tokens(eng) == first


@SAME_SIZES["tiny-gemma3"]
def test_fork_shares_full_blocks_and_frees_them_once():
    eng = Engine(tiny("tiny-gemma3"), num_blocks=PARITY_BLOCKS["tiny-gemma3", "vllm"], block_size=8, max_requests=4,
                 max_model_len=MAX_LEN, token_budget=32, token_buckets=(32,), impl="reference")
    parent = eng.add_request(workload()[1], 6)
    eng.step()
    eng.step()  # prefill in two chunks (52 tokens: 6 full blocks) + first token
    p = eng.requests[parent]
    tables = np.asarray(eng.state.alloc.tables[p.slot])     # [G, M]
    full = tables[:, :p.computed // 8]
    shared = full[full > 0]
    child = eng.fork(parent)
    ref = np.asarray(eng.state.alloc.block_pool.free_queue.ref_count)
    assert (ref[shared] == 2).all()
    out = eng.run()
    assert out[child] == out[parent]  # greedy: the child continues exactly like its parent
    ref = np.asarray(eng.state.alloc.block_pool.free_queue.ref_count)
    assert not ref.any() and int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1


@SAME_SIZES["tiny-llama4"]
def test_orbax_save_and_load_continue_generation_bit_exactly(tmp_path):
    def engine():
        e = llama4_engine(seed=5)
        e.temperature = 0.8
        return e

    eng = engine()
    for p in workload(2)[:3]:
        eng.add_request(p, 6)
    for _ in range(3):
        eng.step()
    eng.save(tmp_path / "ckpt")
    want = run_tokens(eng)
    other = engine()
    other.load(tmp_path / "ckpt")
    assert run_tokens(other) == want


@SAME_SIZES["tiny-llama4"]
def test_abort_ends_requests_in_every_state_and_frees_their_blocks():
    """Aborted: a preempted request whose preemption is still pending, a waiting one the allocator refused
    (its tokens in a slot), a running one mid-decode. They keep exactly the tokens sampled so far (the
    dense model's), the others finish with the dense model's tokens, a request added after reuses the
    slots, and at the end every block is free."""
    model = tiny("tiny-llama4")
    eng = llama4_engine(seed=0)
    prompts = workload()
    ids = [eng.add_request(p, 8) for p in prompts]
    got = {rid: [] for rid in ids}

    def step():
        for rid, tok in eng.step():
            got[rid].append(tok)

    while not eng.stats.preemptions:  # this pool preempts within a few steps (the parity test's sizes)
        assert eng.has_work
        step()
    victim = eng.waiting[0]  # a preempted request waits at the front; its blocks go in the next step
    refused = [rid for rid in eng.waiting[1:] if eng.requests[rid].slot >= 0]
    assert refused, "expected a waiting request the allocator refused"
    aborted = [victim, refused[0]]
    for rid in aborted:
        assert eng.abort(rid)
    while eng.waiting or not eng.running:  # every request left decodes, nothing waits
        assert eng.has_work
        step()
    running = eng.running[0]
    sampled = len(got[running])
    assert eng.abort(running)
    aborted.append(running)
    assert not eng.abort(running)  # already ended
    with pytest.raises(KeyError, match="no request 99"):
        eng.abort(99)
    step()
    late = eng.add_request(prompts[0][:20], 4)
    got[late] = []
    while eng.has_work:
        step()
    assert len(got[running]) == sampled < 8
    assert eng.stats.aborted == 3
    for rid, p in zip(ids + [late], prompts + [prompts[0][:20]]):
        r = eng.requests[rid]
        assert r.generated == got[rid] and r.done and r.slot == -1 and r.aborted == (rid in aborted)
        want, _ = dense_greedy(model, p, r.max_new_tokens)
        assert r.generated == want[:len(r.generated)], f"request {rid}"
        if rid not in aborted:
            assert len(r.generated) == r.max_new_tokens
        assert r.arrival_time <= (r.first_token_time or r.arrival_time) <= r.finished_time
        assert (r.first_token_time is None) == (not r.generated)
    assert int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1
    assert not np.asarray(eng.state.alloc.block_pool.free_queue.ref_count).any()


@SAME_SIZES["tiny-llama4"]
def test_requests_sample_with_their_own_temperature_and_top_p():
    """Under an engine that samples at temperature 1, a request with temperature 0 and one whose top-p
    keeps only the likeliest token both decode the dense model's greedy tokens; one with the engine's
    sampling does not (fixed seed)."""
    model = tiny("tiny-llama4")
    eng = llama4_engine(seed=1)
    eng.temperature = 1.0
    prompts = workload(3)
    cuts = [{"temperature": 0.0}, {"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}]
    greedy = [eng.add_request(p, 8, **cut) for p, cut in zip(prompts, cuts)]
    default = eng.add_request(prompts[0], 8)
    out = eng.run()
    assert eng.stats.array_steps > 0  # decode-only steps planned from the decode record's arrays
    for rid, p in zip(greedy, prompts):
        assert out[rid] == dense_greedy(model, p, 8)[0], eng.requests[rid]
    assert out[default] != dense_greedy(model, prompts[0], 8)[0]
    for bad in ({"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": -1}, {"top_k": 2.5}, {"min_p": 1.5}, {"min_p": "0.1"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            eng.add_request(prompts[0], 2, **bad)
    eng.add_request(prompts[0], 2)
    eng.min_p = 2.0
    with pytest.raises(ValueError, match="min_p must be in"):  # the engine's values, checked by the step
        eng.step()
    eng.min_p = 0.0
    assert len(eng.run()[default + 1]) == 2


def dense_penalized(model: TinyLM, prompt: list[int], n: int, repetition: float = 1.0, presence: float = 0.0,
                    frequency: float = 0.0, bias: dict[int, float] | None = None, masked: tuple[int, ...] = (),
                    min_tokens: int = 0) -> list[int]:
    """Greedy tokens of the uncached model under a logit ``bias`` and vLLM's penalties, applied in numpy
    in vLLM's order; the ``masked`` tokens are left out of the first ``min_tokens``."""
    dense = jax.jit(model.dense)
    toks = list(prompt)
    for _ in range(n):
        row = np.asarray(dense(jnp.asarray(toks + [0] * (MAX_LEN - len(toks))))[len(toks) - 1]).astype(np.float64)
        out = toks[len(prompt):]
        for t, v in (bias or {}).items():
            row[t] += v
        if len(out) < min_tokens:
            row[list(masked)] = -np.inf
        for t in set(toks):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        toks.append(int(row.argmax()))
    return toks[len(prompt):]


@SAME_SIZES["tiny-llama4"]
def test_penalties_equal_vllms_on_the_dense_model():
    """Greedy requests under repetition / presence / frequency penalties decode what the dense model's
    logits, penalised in numpy, give (vLLM's rules), in one batch with a request without them."""
    model = tiny("tiny-llama4")
    eng = llama4_engine(seed=0)
    prompts = [p[:10] for p in workload(6)[:3]]
    prompts[0] += dense_greedy(model, prompts[0], 3)[0]  # the tokens it would go on with are in its prompt
    cases = [{"repetition": 2.0}, {"repetition": 1.2, "presence": 1.0, "frequency": 0.5}, {}]
    names = {"repetition": "repetition_penalty", "presence": "presence_penalty", "frequency": "frequency_penalty"}
    ids = [eng.add_request(p, 8, **{names[k]: v for k, v in case.items()}) for p, case in zip(prompts, cases)]
    out = eng.run()
    assert eng.stats.array_steps > 0
    for rid, p, case in zip(ids, prompts, cases):
        assert out[rid] == dense_penalized(model, p, 8, **case), case
    assert out[ids[0]] != dense_greedy(model, prompts[0], 8)[0]  # the penalty changed something
    for bad in ({"repetition_penalty": 0.0}, {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            eng.add_request(prompts[0], 2, **bad)


def test_sample_cuts_min_p_and_top_k_then_top_p_of_what_is_left():
    """vLLM's order on a 4-token distribution: top-p applies to the renormalised tokens that min-p and
    top-k keep; 512 rows, a seed each, show which tokens can be drawn."""
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
    key, seeds = jax.random.PRNGKey(0), jnp.arange(512)

    def drawn(**cut):
        return set(np.asarray(sample(logits, key, 1.0, seed=seeds, **cut)).tolist())

    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_k=2) == drawn(min_p=0.5) == drawn(top_p=0.6) == drawn(top_k=3, top_p=0.6) == {0, 1}
    assert drawn(top_k=2, top_p=0.6) == {0}  # 0.5 / 0.8 of the two kept reaches 0.6
    assert drawn(min_p=0.2, top_k=3) == {0, 1, 2}
    assert drawn(min_p=2.0) == {0}  # past 1: the likeliest token still stays
    assert set(np.asarray(sample(logits, key, 0.0, top_k=3)).tolist()) == {0}  # greedy ignores the cuts


def test_ranking_only_the_likeliest_candidates_draws_what_sorting_all_draws():
    """Rows with random temperatures, cuts and seeds: the sampler ranking 8 candidates (a row keeping more
    sorts its whole vocabulary) draws exactly the tokens it draws sorting all 300, each token's noise
    coming from its id; both branches are taken."""
    rng = np.random.default_rng(0)
    B, V = 256, 300
    logits = jnp.asarray(rng.normal(0, 3, (B, V)), jnp.float32)
    cuts = {"temperature": rng.choice([0.0, 0.5, 1.0, 2.0], B), "top_p": rng.choice([0.3, 0.9, 1.0], B),
            "top_k": rng.choice([0, 2, 5, 20], B), "min_p": rng.choice([0.0, 0.05, 0.5], B),
            "seed": rng.integers(-1, 5, B)}
    cuts = {name: jnp.asarray(v, jnp.int32 if name in ("top_k", "seed") else jnp.float32) for name, v in cuts.items()}
    key = jax.random.PRNGKey(3)
    few, every = (np.asarray(sample(logits, key, **cuts, candidates=n)) for n in (8, V))
    assert (few == every).all()
    fit = np.asarray(sample(logits, key, **{**cuts, "top_k": jnp.full(B, 2)}, candidates=8))
    assert (fit == np.asarray(sample(logits, key, **{**cuts, "top_k": jnp.full(B, 2)}, candidates=V))).all()


@SAME_SIZES["tiny-llama4"]
def test_a_seeded_request_samples_the_same_tokens_in_any_batch():
    """Sampling at temperature 1: a request with a seed draws the same tokens served alone and served
    last in a batch that preempts it, under another engine key; the same prompt with another seed draws
    others. A fork given the parent's seed continues the parent's tokens; an unseeded fork does not."""
    prompts = workload(4)
    alone = llama4_engine(seed=1)
    alone.temperature = 1.0
    first = alone.add_request(prompts[0], 8, seed=5)
    while len(alone.requests[first].generated) < 3:
        alone.step()
    same, unseeded = alone.fork(first, seed=5), alone.fork(first)
    alone.run()
    want = alone.requests[first].generated
    assert alone.requests[same].generated == want and alone.requests[unseeded].generated != want
    eng = llama4_engine(seed=2)
    eng.temperature = 1.0
    for p in prompts[1:]:
        eng.add_request(p, 8)
    seeded, other = eng.add_request(prompts[0], 8, seed=5), eng.add_request(prompts[0], 8, seed=6)
    out = eng.run()
    assert eng.requests[seeded].preemptions > 0 and eng.stats.array_steps > 0
    assert out[seeded] == want and out[other] != want
    for bad in (-1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer"):
            eng.add_request(prompts[0], 2, seed=bad)
    # On flat logits: a seed's draws differ by position, and one seed at one position draws one token.
    flat, key = jnp.zeros((8, 256)), jax.random.PRNGKey(0)
    assert len(set(np.asarray(sample(flat, key, 1.0, 1.0, seed=5, position=jnp.arange(8))).tolist())) > 1
    assert len(set(np.asarray(sample(flat, key, 1.0, 1.0, seed=5, position=3)).tolist())) == 1
    assert len(set(np.asarray(sample(flat, key, 1.0, 1.0)).tolist())) > 1  # unseeded rows: a key each


@SAME_SIZES["tiny-llama4"]
def test_logprobs_are_the_dense_models_log_softmax_at_each_generated_token():
    """A request that asks for log-probabilities gets, per generated token, the dense model's log-softmax
    at that token, also when it samples at temperature 2 (they are the model's, not the tempered
    ones), and the likeliest tokens with theirs when it asks for them (3 and 2 of the engine's 3),
    through the decode-only record's multi-step programs; requests that do not ask get none."""
    model = tiny("tiny-llama4")
    dense = jax.jit(model.dense)
    eng = llama4_engine(seed=4)
    assert eng.max_top_logprobs == 3
    prompts = [p[:10] for p in workload(5)[:3]]  # short: the three decode together, in one record
    plain = eng.add_request(prompts[2], 8)
    greedy = eng.add_request(prompts[0], 8, logprobs=True, top_logprobs=3)
    hot = eng.add_request(prompts[1], 8, temperature=2.0, seed=1, top_logprobs=2)
    eng.run()
    assert eng.stats.array_steps >= 5
    assert eng.requests[plain].logprobs is None and eng.requests[plain].top_logprobs is None
    for rid, prompt, n in ((greedy, prompts[0], 3), (hot, prompts[1], 2)):
        r = eng.requests[rid]
        toks = prompt + r.generated
        rows = np.asarray(jax.nn.log_softmax(dense(jnp.asarray(toks + [0] * (MAX_LEN - len(toks))))))
        rows = rows[len(prompt) - 1:len(toks) - 1]
        assert len(r.logprobs) == len(r.generated) == len(r.top_logprobs) == 8
        np.testing.assert_allclose(r.logprobs, rows[np.arange(8), r.generated], atol=1e-4, rtol=0)
        likeliest = np.argsort(-rows, axis=-1)[:, :n]
        assert [[t for t, _ in top] for top in r.top_logprobs] == likeliest.tolist()
        np.testing.assert_allclose([[v for _, v in top] for top in r.top_logprobs],
                                   np.take_along_axis(rows, likeliest, -1), atol=1e-4, rtol=0)
    for bad, engine in ((4, eng), (1, llama4_engine(seed=0, max_top_logprobs=0)), (-1, eng)):
        with pytest.raises(ValueError, match="top_logprobs must be an integer in"):
            engine.add_request(prompts[0], 2, top_logprobs=bad)
    assert eng.requests[greedy].generated == dense_greedy(model, prompts[0], 8)[0]
    # Times: a prompt of budget + 1 tokens samples its first token in a 1-token step, booked then too.
    eng.add_request(list(range(100, 133)), 4)  # no cache hit: chunks of 32 and 1
    eng.run()
    for r in eng.requests.values():
        assert 0 < r.arrival_time <= r.first_token_time <= r.finished_time, r


def two_letters(ids) -> str:
    """A detokenizer whose tokens are two letters each, so a stop string can end inside a token."""
    return "".join(chr(97 + t % 26) + chr(97 + t // 26 % 26) for t in ids)


@SAME_SIZES["tiny-llama4"]
def test_stop_strings_end_a_request_inside_its_text_and_finish_reasons_say_why():
    """A request ends at the token whose text completes a stop string: it keeps the tokens it samples
    without one up to that token, ``text`` ends before the string (inside a token), and the others in its
    batch generate as without it. ``finish_reason``: a stop string and a stop token give "stop", the
    token limit "length", ``abort`` "abort". (Seeded sampling: the tiny model's greedy tokens repeat.)
    The stop string comes late, where the engine searches only the last 20 tokens' text."""
    prompts = [p[:12] for p in workload(6)]
    sampling = [{"temperature": 1.0, "seed": i} for i in range(3)]
    free = llama4_engine(seed=0, detokenize=two_letters)
    lengths = [40, 8, 40]
    ids = [free.add_request(p, n, **kw) for p, n, kw in zip(prompts, lengths, sampling)]
    want = [free.run()[i] for i in ids]
    text = two_letters(want[0])
    # The first 3 letters starting at an odd letter (across a token boundary) from the 26th token to the
    # 35th that do not occur earlier.
    at = next(i for i in range(51, 70, 2) if text.find(text[i:i + 3]) == i)
    last = (at + 2) // 2  # the token whose letters complete it
    eng = llama4_engine(seed=1, detokenize=two_letters)
    by_string = eng.add_request(prompts[0], 40, stop_strings=["zzzzzz", text[at:at + 3]], **sampling[0])
    by_token = eng.add_request(prompts[1], 8, stop=(want[1][4],), **sampling[1])
    by_length = eng.add_request(prompts[2], 40, **sampling[2])
    aborted = eng.add_request(prompts[3], 8)
    eng.step()
    eng.abort(aborted)
    eng.run()
    r = eng.requests
    assert r[by_string].generated == want[0][:last + 1] and r[by_string].stop_string == text[at:at + 3]
    assert eng.text(by_string) == text[:at] and eng.text(by_length) == two_letters(want[2])
    assert r[by_token].generated == want[1][:want[1].index(want[1][4]) + 1]
    assert r[by_length].generated == want[2] and eng.stats.array_steps > 0  # the record, once it ended
    assert [r[i].finish_reason for i in (by_string, by_token, by_length, aborted)] == ["stop", "stop", "length",
                                                                                     "abort"]
    assert all(r[i].done for i in r)
    kept = r[by_length]
    assert eng.forget(by_length) is kept and by_length not in eng.requests  # a server keeps no record
    with pytest.raises(ValueError, match="request 4 is not done"):
        eng.forget(eng.add_request(prompts[0], 2))
    with pytest.raises(ValueError, match="non-empty strings"):
        eng.add_request(prompts[0], 2, stop_strings=["ab", ""])
    plain = llama4_engine(seed=0)
    with pytest.raises(ValueError, match="detokenize"):
        plain.add_request(prompts[0], 2, stop_strings="ab")
    with pytest.raises(ValueError, match="detokenize"):
        plain.text(plain.add_request(prompts[0], 2))


@SAME_SIZES["tiny-llama4"]
def test_logit_bias_and_min_tokens_steer_greedy_decoding_as_on_the_dense_model():
    """In one batch: a request with logit biases, one whose stop token (its first greedy token) is masked
    for its first 3 tokens (``min_tokens``), one with a bias under a repetition penalty (bias first, as
    vLLM), and a plain one, each equal to the dense model's greedy tokens under the same rules in
    numpy, through the decode-only record. Then a stop string found in the first ``min_tokens`` tokens'
    text does not end a request."""
    model = tiny("tiny-llama4")
    eng = llama4_engine(seed=0, detokenize=two_letters)
    prompts = [p[-10:] for p in workload(8)]  # four different prompts
    greedy = [dense_greedy(model, p, 8)[0] for p in prompts]
    bias = {greedy[0][0]: -5.0, 7: 3.0, 11: 2.5}
    stop = greedy[3][0]
    ids = [eng.add_request(prompts[0], 8, logit_bias=bias),
           eng.add_request(prompts[3], 8, stop=(stop,), min_tokens=3),
           eng.add_request(prompts[2], 8, repetition_penalty=1.5, logit_bias={greedy[2][1]: 4.0}),
           eng.add_request(prompts[1], 8)]
    out = eng.run()
    assert eng.stats.array_steps > 0
    assert out[ids[0]] == dense_penalized(model, prompts[0], 8, bias=bias) != greedy[0]
    # Its greedy tokens repeat the stop token; masked, the model picks another until the 4th token.
    want = dense_penalized(model, prompts[3], 8, masked=(stop,), min_tokens=3)
    end = want.index(stop) + 1
    assert out[ids[1]] == want[:end] and end == 4 and eng.requests[ids[1]].finish_reason == "stop"
    assert out[ids[2]] == dense_penalized(model, prompts[2], 8, repetition=1.5, bias={greedy[2][1]: 4.0})
    assert out[ids[3]] == greedy[1]  # the other rows' entries leave it alone
    # Under min_tokens=2 a stop string counts only where it ends after the first 2 tokens' 4 letters.
    word = two_letters(greedy[1][:1])
    early = eng.add_request(prompts[1], 8, stop_strings=[word])
    late = eng.add_request(prompts[1], 8, stop_strings=[word], min_tokens=2)
    eng.run()
    text = two_letters(greedy[1])
    assert eng.text(early) == "" and eng.requests[early].generated == greedy[1][:1]
    at = text.find(word, 3)  # its tokens repeat one id: at 4, in the third token
    assert eng.text(late) == text[:at] and eng.requests[late].generated == greedy[1][:(at + len(word) + 1) // 2]
    for bad, match in (({"logit_bias": {3: 101.0}}, "to values in \\[-100, 100\\]"),
                       ({"logit_bias": {256: 1.0}}, "logit_bias maps tokens in \\[0, 256\\)"),
                       ({"logit_bias": [(3, 1.0)]}, "logit_bias must be a dict"),
                       ({"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}, "min_tokens": 1, "stop": (5, 6)},
                        "need 5 bias entries"),
                       ({"min_tokens": 9}, "min_tokens must be an integer in \\[0, max_new_tokens\\]")):
        with pytest.raises(ValueError, match=match):
            eng.add_request(prompts[0], 8, **bad)
    with pytest.raises(ValueError, match="max_logit_bias 0"):
        llama4_engine(seed=0, max_logit_bias=0).add_request(prompts[0], 8, logit_bias={1: 1.0})


def test_bad_requests_are_refused_with_clear_errors():
    model = tiny("tiny-gemma3")
    # One request of 16 tokens holds 2 blocks of block size 8 in each of the 6 groups (1 full attention,
    # 5 sliding-window): a smaller pool is refused before anything compiles.
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 16 tokens: it needs 12 blocks"):
        Engine(model, num_blocks=12, block_size=8, max_requests=2, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len 7 is under one block: a request must have room for at least 8"):
        Engine(model, num_blocks=64, block_size=8, max_model_len=7)
    with pytest.raises(ValueError, match="token_budget must be a positive integer"):
        Engine(model, num_blocks=64, token_budget=0)
    for seconds in (0, -0.02, float("inf"), float("nan"), True, "0.02"):
        with pytest.raises(ValueError, match="max_call_seconds must be a positive number of seconds or None"):
            Engine(model, num_blocks=64, decode_steps=8, max_call_seconds=seconds)
    eng = Engine(model, num_blocks=26, block_size=8, max_requests=2, max_model_len=32,
                 token_budget=16, impl="reference")
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request([1] * 30, 5)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        eng.add_request([300], 2)
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request([], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        eng.add_request([1], 0)
