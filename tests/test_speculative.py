"""Speculative decoding's drafts against a plain-Python statement of prompt lookup, and their verification."""

import collections

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_jax.engine import DraftModelSpec, Engine, EngineConfig, SamplingParams
from hkv_jax.engine.request import keeps_drafting
from hkv_jax.engine.speculative import NgramSpec, accepted_drafts, ngram_drafts
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM

T = 24


def lookup(seq: list[int], spec: NgramSpec) -> list[int]:
    """The k tokens after the latest earlier occurrence of the last n tokens, the largest n first."""
    for n in range(spec.prompt_lookup_max, spec.prompt_lookup_min - 1, -1):
        if len(seq) < n:
            continue
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s:s + n] == seq[len(seq) - n:]:
                return seq[s + n:s + n + spec.num_speculative_tokens]
    return []


_DRAFTS = {}


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=T), min_size=1, max_size=4),
       k=st.integers(1, 4), lo=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_drafts_follow_the_latest_longest_earlier_match(seqs, k, lo, extra):
    spec = NgramSpec(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=lo + extra)
    tokens = np.full((4, T), 7, np.int32)  # the rows past each length hold tokens no prompt has
    lengths = np.zeros(4, np.int32)
    for b, seq in enumerate(seqs):
        tokens[b, :len(seq)], lengths[b] = seq, len(seq)
    fn = _DRAFTS.setdefault(spec, jax.jit(lambda t, n, spec=spec: ngram_drafts(t, n, spec)))
    draft, count = jax.device_get(fn(tokens, lengths))
    for b, seq in enumerate(seqs):
        want = lookup(seq, spec)
        assert draft[b, :count[b]].tolist() == want, (seq, spec)
        assert not draft[b, count[b]:].any()


@pytest.mark.parametrize("fields, message", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=True), "prompt_lookup_min must be an integer >= 1"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "must not exceed"),
])
def test_bad_ngram_specs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        NgramSpec(**fields)


def test_a_request_stops_drafting_when_its_drafts_give_too_little():
    # (speculative steps, draft tokens verified, accepted): judged by tokens after 64 draft tokens (10%), by
    # steps after 8 (half a token per step), whichever comes first.
    assert keeps_drafting(7, 63, 0) and keeps_drafting(7, 64, 7)
    assert not keeps_drafting(7, 64, 6)
    assert keeps_drafting(8, 10, 4) and not keeps_drafting(8, 10, 3)
    assert not keeps_drafting(40, 0, 19) and keeps_drafting(40, 190, 20)


def test_verification_accepts_drafts_up_to_the_first_that_differs_from_the_targets_token():
    # The target's tokens at each position: 3, 1, 4, 0. Drafts: all right (4 emitted), wrong at 2, wrong at 0,
    # a 1-token draft (right), no draft; a right token past the draft's count is not accepted.
    sampled = np.array([[3, 1, 4, 0]] * 5, np.int32)
    draft = np.array([[3, 1, 4], [3, 1, 2], [2, 1, 4], [3, 1, 4], [0, 0, 0]], np.int32)
    count = np.array([3, 3, 3, 1, 0], np.int32)
    assert jax.device_get(accepted_drafts(draft, count, sampled)).tolist() == [3, 2, 0, 1, 0]


# --- the engine with speculative decoding ------------------------------------------------------------

# One size for every engine here, in one worker: each program compiles once.
SIZES = dict(num_blocks=160, block_size=8, max_requests=4, max_model_len=96, token_budget=32, token_buckets=(32,),
             impl="reference")
SPEC = NgramSpec(3)
ENGINES = pytest.mark.xdist_group("speculative-engines")


def engine(speculative: bool, seed: int = 0) -> Engine:
    from test_engine import tiny

    return Engine(tiny("tiny-gemma3"), seed=seed, speculative=SPEC if speculative else None, **SIZES)


def periodic(seed: int, n: int = 4) -> list[list[int]]:
    """Prompts that repeat a random phrase: the drafts find it, the random model mostly does not follow it."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, 6)] * 5 + [int(t) for t in rng.integers(0, 256, 3)]
            for _ in range(n)]


def cached_hashes(eng: Engine) -> set:
    """(block hash, group) of every prefix-cache entry (freed window blocks taken again leave: the sets
    of two runs differ by group)."""
    cache = jax.device_get(eng.state.alloc.block_pool.prefix_cache)
    return {(tuple(cache.keys[s]), g) for s, g in zip(*np.nonzero(cache.block))}


PARAMS = [SamplingParams(20),
          SamplingParams(20, temperature=1.0, top_k=5, seed=7),
          SamplingParams(20, temperature=0.8, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4, seed=11),
          SamplingParams(20, stop=(3,), speculative=False)]


@ENGINES
def test_speculation_keeps_greedy_seeded_and_penalised_tokens_and_caches_only_verified_blocks():
    """Greedy, seeded (with cuts and penalties) and opted-out requests give the same tokens with drafts
    verified and rejected; the prefix cache then holds only blocks of verified tokens, and nothing leaks."""
    runs = {}
    for speculative in (False, True):
        eng = engine(speculative)
        ids = [eng.add_request(p, params) for p, params in zip(periodic(0), PARAMS)]
        out = eng.run()
        runs[speculative] = [out[i] for i in ids], cached_hashes(eng), eng
    (plain, plain_cached, _), (spec, spec_cached, eng) = runs[False], runs[True]
    assert spec == plain
    s = eng.stats
    assert s.spec_draft_tokens > s.spec_accepted_tokens > 0  # rejections and acceptances both
    assert eng.requests[3].draft_tokens == 0  # it opted out
    # The plain run cached every full block of verified tokens (in its full-attention groups, which this
    # pool never evicts): each block the speculative run cached holds verified tokens only.
    assert {h for h, _ in spec_cached} <= {h for h, _ in plain_cached}
    free_queue = eng.state.alloc.block_pool.free_queue
    assert int(free_queue.num_free) == eng.layout.num_blocks - 1 and not np.asarray(free_queue.ref_count).any()


@ENGINES
def test_sampled_tokens_keep_their_distribution_with_speculation():
    """Chi-square (two samples): unseeded requests at temperature 1 with top-k 4 draw their second and third
    tokens from the same distribution with drafts as without."""
    from scipy.stats import chi2_contingency

    prompt = periodic(1, 1)[0]
    counts = {}
    for speculative in (False, True):
        eng = engine(speculative, seed=speculative)
        ids = [eng.add_request(prompt, SamplingParams(3, temperature=1.0, top_k=4)) for _ in range(240)]
        eng.run()
        for pos in (1, 2):
            counts[speculative, pos] = collections.Counter(eng.requests[i].generated[pos] for i in ids)
        if speculative:
            assert eng.stats.spec_accepted_tokens > 20 and eng.stats.spec_draft_tokens > eng.stats.spec_accepted_tokens
    for pos in (1, 2):
        tokens = sorted(set(counts[False, pos]) | set(counts[True, pos]))
        table = np.array([[counts[spec, pos][t] for t in tokens] for spec in (False, True)])
        table = table[:, table.sum(0) >= 10]  # categories seen often enough for the test
        assert table.shape[1] >= 2 and chi2_contingency(table).pvalue > 1e-3


@ENGINES
def test_snapshots_forks_and_checkpoints_with_speculation(tmp_path):
    eng = engine(True, seed=3)
    for p in periodic(2, 2):
        eng.add_request(p, SamplingParams(16, temperature=0.7, seed=2))
    parent = eng.add_request(periodic(3, 1)[0], 16)
    for _ in range(4):
        eng.step()
    snap = eng.snapshot()
    eng.save(tmp_path / "ckpt")
    first = {rid: list(t) for rid, t in eng.run().items()}
    eng.restore(snap)
    assert {rid: list(t) for rid, t in eng.run().items()} == first
    other = engine(True, seed=3)
    other.load(tmp_path / "ckpt")
    assert {rid: list(t) for rid, t in other.run().items()} == first
    eng.restore(snap)
    child = eng.fork(parent)
    out = eng.run()
    assert out[child] == out[parent] == first[parent]  # greedy: the child continues like its parent


@ENGINES
def test_a_draft_model_proposes_and_the_tokens_stay_the_targets():
    """A tiny model (here the target's own weights, so that its greedy drafts are mostly right) drafts for
    another: greedy, seeded, penalised and opted-out requests give the tokens they give without drafts."""
    from test_engine import tiny

    prompts = periodic(4)
    plain = engine(False)
    ids = [plain.add_request(p, params) for p, params in zip(prompts, PARAMS)]
    out = plain.run()
    eng = Engine(tiny("tiny-gemma3"), speculative=DraftModelSpec(tiny("tiny-gemma3"), 2), **SIZES)
    spec_ids = [eng.add_request(p, params) for p, params in zip(prompts, PARAMS)]
    got = eng.run()
    assert [got[i] for i in spec_ids] == [out[i] for i in ids]
    greedy = eng.requests[spec_ids[0]]  # the draft decodes as the target does: its drafts are right
    assert greedy.draft_tokens > 0 and greedy.accepted_tokens >= greedy.draft_tokens - 2
    assert eng.stats.spec_draft_tokens > eng.stats.spec_accepted_tokens  # the sampled ones' are often not


def test_bad_speculative_configs_are_refused_before_anything_compiles():
    from test_engine import tiny

    with pytest.raises(ValueError, match="token budget of at least 5"):
        EngineConfig(num_blocks=64, token_budget=4, speculative=NgramSpec(4))
    with pytest.raises(ValueError, match="no room for a draft"):
        EngineConfig(num_blocks=64, max_model_len=4, token_budget=8, speculative=NgramSpec(3))
    with pytest.raises(ValueError, match="NgramSpec"):
        EngineConfig(num_blocks=64, speculative=3)
    with pytest.raises(ValueError, match="speculative must be True or False"):
        SamplingParams(4, speculative="yes")
    with pytest.raises(ValueError, match="needs cfg, hidden and logits"):
        DraftModelSpec(object(), 2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        DraftModelSpec(tiny("tiny-gemma3"), 0)
    other = TinyLM(TinyConfig.from_hf(dict(resolve_model("tiny-gemma3")[1], vocab_size=128)), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(128 tokens\) is not the target's \(256\)"):
        Engine(tiny("tiny-gemma3"), num_blocks=64, speculative=DraftModelSpec(other, 2))
