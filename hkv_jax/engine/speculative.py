"""Speculative decoding: what proposes draft tokens.

``NgramSpec`` is vLLM's ``ngram`` method (prompt lookup): a request's draft is the ``k`` tokens that followed
the latest earlier occurrence of its last ``n`` tokens, for the largest ``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min`` that occurs earlier in its prompt and output. ``ngram_drafts`` computes the
drafts of a batch on the device, as a pure jnp function (it runs inside a step program);
``rejection_sample`` verifies them against the target model's distributions: greedy requests accept a
draft token where it is the argmax, sampled ones with probability ``p(draft)`` (a deterministic draft's
rejection sampling, which leaves every emitted token distributed as the target says).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from hkv_jax.engine.sampling_params import is_integer


@dataclass(frozen=True)
class NgramSpec:
    """Draft by prompt lookup: ``num_speculative_tokens`` tokens per step, matching the last
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")


def ngram_drafts(tokens: jax.Array, lengths: jax.Array, spec: NgramSpec) -> tuple[jax.Array, jax.Array]:
    """The drafts of a batch: ``tokens: i32[B, T]`` (request ``b``'s first ``lengths[b]`` are its prompt and
    output so far). Returns (``i32[B, k]`` draft tokens, 0 past the draft; ``i32[B]`` draft lengths, 0 where
    no n-gram of the allowed sizes occurs earlier). A draft is shorter than ``k`` when the match ends less
    than ``k`` tokens before the end. O(B x T x n) comparisons per n."""
    B, T = tokens.shape
    k = spec.num_speculative_tokens
    pos = jnp.arange(T)
    best_end = jnp.full(B, -1, jnp.int32)  # where the chosen occurrence ends (its next token's index)
    # The largest n with an earlier occurrence wins: going up, each n that matches replaces the shorter one's.
    for n in range(spec.prompt_lookup_min, spec.prompt_lookup_max + 1):
        match = jnp.ones((B, T), bool)  # match[b, s]: tokens[s : s + n] equal the last n tokens
        for j in range(n):
            last = jnp.take_along_axis(tokens, jnp.maximum(lengths - n + j, 0)[:, None], axis=1)  # [B, 1]
            shifted = jnp.take(tokens, jnp.minimum(pos + j, T - 1), axis=1)                        # [B, T]
            match &= shifted == last
        # An earlier occurrence: it starts before the suffix does (it may overlap it).
        match &= pos[None, :] < (lengths - n)[:, None]
        latest = jnp.max(jnp.where(match, pos[None, :], -1), axis=1)
        best_end = jnp.where((latest >= 0) & (lengths >= n), latest + n, best_end)
    count = jnp.where(best_end >= 0, jnp.clip(lengths - best_end, 0, k), 0)
    idx = jnp.clip(best_end[:, None] + jnp.arange(k)[None, :], 0, T - 1)
    draft = jnp.where(jnp.arange(k)[None, :] < count[:, None], jnp.take_along_axis(tokens, idx, axis=1), 0)
    return draft.astype(jnp.int32), count.astype(jnp.int32)


def rejection_sample(draft: jax.Array, count: jax.Array, probs: jax.Array, greedy: jax.Array,
                     key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Verify deterministic drafts. ``draft: i32[B, k]`` with ``count: i32[B]`` valid tokens each;
    ``probs: f32[B, k + 1, V]`` the target's sampling distribution at each position (position ``i``: after
    the draft's first ``i`` tokens); ``greedy: bool[B]``; ``key``: a PRNG key.

    Returns (``i32[B, k + 1]`` the tokens to emit, ``i32[B]`` how many: the accepted draft prefix, then one
    token of the target's: at the first rejected position from ``p`` without the rejected token
    (renormalised), or after a wholly accepted draft from ``p`` itself; 0 past them). Each emitted token
    is distributed as the target's ``p`` at its position, whatever the draft."""
    B, k = draft.shape
    accept_key, sample_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(probs[:, :k], draft[..., None], axis=-1)[..., 0]               # [B, k]
    is_argmax = jnp.argmax(probs[:, :k], axis=-1) == draft
    ok = jnp.where(greedy[:, None], is_argmax, jax.random.uniform(accept_key, (B, k)) < p_draft)
    ok &= jnp.arange(k)[None, :] < count[:, None]
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)                          # [B]
    p = jnp.take_along_axis(probs, accepted[:, None, None], axis=1)[:, 0]                          # [B, V]
    rejected = jnp.take_along_axis(draft, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    residual = jnp.where((accepted < count)[:, None] & (jnp.arange(p.shape[-1])[None, :] == rejected[:, None]),
                         0.0, p)
    sampled = jax.random.categorical(sample_key, jnp.log(residual))
    last = jnp.where(greedy, jnp.argmax(p, axis=-1), sampled).astype(jnp.int32)
    pos = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(pos < accepted[:, None], jnp.pad(draft, ((0, 0), (0, 1))), 0)
    tokens = jnp.where(pos == accepted[:, None], last[:, None], tokens)
    return tokens.astype(jnp.int32), accepted + 1
