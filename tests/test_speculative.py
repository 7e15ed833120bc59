"""Speculative decoding's drafts against a plain-Python statement of prompt lookup."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_jax.engine.speculative import NgramSpec, ngram_drafts, rejection_sample

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


def test_greedy_verification_accepts_the_argmax_prefix_then_the_targets_token():
    # Target argmax per position: 3, 1, 4, 0. Drafts: all right (bonus 0 after 3 tokens), wrong at 2 (the
    # target's 4 replaces it), a 1-token draft, no draft.
    probs = np.zeros((4, 4, 5), np.float32)
    for i, t in enumerate([3, 1, 4, 0]):
        probs[:, i, t] = 1.0
    draft = np.array([[3, 1, 4], [3, 1, 2], [3, 0, 0], [0, 0, 0]], np.int32)
    count = np.array([3, 3, 1, 0], np.int32)
    tokens, n = jax.device_get(rejection_sample(draft, count, probs, np.ones(4, bool), jax.random.key(0)))
    assert n.tolist() == [4, 3, 2, 1]
    assert tokens.tolist() == [[3, 1, 4, 0], [3, 1, 4, 0], [3, 1, 0, 0], [3, 0, 0, 0]]


def test_sampled_verification_keeps_the_targets_distribution():
    """Chi-square: with a draft token the target finds unlikely (and one it finds likely), the first emitted
    token is distributed as the target's p; after an accepted draft token the second one is too."""
    from scipy.stats import chisquare

    p0 = np.array([0.1, 0.5, 0.05, 0.25, 0.1])
    p1 = np.array([0.3, 0.1, 0.2, 0.2, 0.2])
    probs = np.stack([p0, p1])[None].astype(np.float32)                      # [1, 2, V]: k = 1
    n = 20000
    keys = jax.random.split(jax.random.key(1), n)
    for x in (2, 1):
        run = jax.jit(jax.vmap(lambda key, x=x: rejection_sample(np.array([[x]], np.int32), np.array([1], np.int32),
                                                                  probs, np.zeros(1, bool), key)))
        tokens, count = jax.device_get(run(keys))
        first = tokens[:, 0, 0]
        assert chisquare(np.bincount(first, minlength=5), p0 * n).pvalue > 1e-3
        second = tokens[first == x, 0, 1]                                     # accepted: the bonus token
        assert (count[first == x, 0] == 2).all() and (count[first != x, 0] == 1).all()
        assert chisquare(np.bincount(second, minlength=5), p1 * len(second)).pvalue > 1e-3
