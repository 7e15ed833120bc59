"""Speculative decoding: what proposes draft tokens.

``DraftModelSpec`` drafts with a second model instead: the ``k`` tokens it decodes greedily after the
request's tokens (``model_drafts``, on the device, in the step program).

``NgramSpec`` is vLLM's ``ngram`` method (prompt lookup): a request's draft is the ``k`` tokens that followed
the latest earlier occurrence of its last ``n`` tokens, for the largest ``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min`` that occurs earlier in its prompt and output. ``ngram_drafts`` computes the
drafts of a batch on the device, as a pure jnp function (it runs inside a step program).

Verification (``accepted_drafts``) samples the target at every draft position exactly as a decode step
there would (same cuts, penalties, and, for a seeded request, the same key: the seed and the position),
and accepts drafts while they equal those tokens. For a deterministic draft this is rejection sampling
itself: a draft token is accepted with probability ``p(draft)``, and on a rejection the emitted token is
drawn from ``p`` without the draft token, renormalised. It also makes a greedy or seeded request's
tokens identical with speculation on or off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

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


@dataclass(frozen=True, eq=False)
class DraftModelSpec:
    """Draft with ``model``: its ``num_speculative_tokens`` greedy tokens after each decoding request's
    tokens. ``model`` needs the ``ScoringModel`` methods (``hidden``, ``logits``: any engine model has them)
    and the target's vocabulary. It runs without a cache of its own (a whole forward over the request's
    tokens per draft token): meant for a small draft model."""

    model: object = field(repr=False)
    num_speculative_tokens: int

    def __post_init__(self):
        k = self.num_speculative_tokens
        if not is_integer(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not all(callable(getattr(self.model, name, None)) for name in ("hidden", "logits")) or not hasattr(
                self.model, "cfg"):
            raise ValueError(f"a draft model needs cfg, hidden and logits (a ScoringModel), got "
                             f"{type(self.model).__name__}")


@dataclass(frozen=True)
class DraftModelStatic:
    """A ``DraftModelSpec`` inside a step program's static part: the draft model's graph and the tree
    structure of its parameters (which the program takes after the target's)."""

    graphdef: nnx.GraphDef
    params_def: jax.tree_util.PyTreeDef
    num_speculative_tokens: int


def model_drafts(model, tokens: jax.Array, lengths: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The drafts of a batch by a draft model: ``tokens: i32[B, T]``, request ``b``'s first ``lengths[b]``
    known. Returns (``i32[B, k]`` the ``k`` tokens the model decodes greedily after them, ``i32[B]`` k
    each, or fewer where the row ends)."""
    T = tokens.shape[1]

    def one(row, n):
        def next_token(j, row):
            at = jnp.clip(n + j - 1, 0, T - 1)
            token = jnp.argmax(model.logits(model.hidden(row)[at][None])[0]).astype(row.dtype)
            return row.at[n + j].set(token, mode="drop")

        row = jax.lax.fori_loop(0, k, next_token, row)
        return jnp.take(row, jnp.clip(n + jnp.arange(k), 0, T - 1))

    draft = jax.vmap(one)(tokens, lengths)
    return draft.astype(jnp.int32), jnp.clip(T - lengths, 0, k).astype(jnp.int32)


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


def accepted_drafts(draft: jax.Array, count: jax.Array, sampled: jax.Array) -> jax.Array:
    """How many leading draft tokens each entry accepts: ``draft: i32[B, k]`` with ``count: i32[B]`` valid
    tokens each, ``sampled: i32[B, k + 1]`` the target's token at each position (position ``i``: after the
    draft's first ``i`` tokens, drawn as a decode step there would draw it). Draft token ``i`` is accepted
    while every one before it was and it equals the token sampled at its position; the entry then emits
    ``sampled[:, :accepted + 1]``. Returns ``i32[B]``."""
    k = draft.shape[1]
    ok = (sampled[:, :k] == draft) & (jnp.arange(k)[None, :] < count[:, None])
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
