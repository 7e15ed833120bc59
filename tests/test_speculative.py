"""Speculative decoding's drafts against a plain-Python statement of prompt lookup."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_jax.engine.speculative import NgramSpec, ngram_drafts

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
