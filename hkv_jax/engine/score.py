"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it (vLLM's
``prompt_logprobs``; what OpenAI's ``echo`` with ``logprobs`` reports, and what evaluation harnesses read
to score a continuation).

The serving step makes logits only where it samples, so this runs apart from it: the model's uncached
forward over the prompt (``model.hidden``), then its vocabulary projection (``model.logits``) a chunk of
positions at a time, so that at most ``[CHUNK, vocab]`` logits exist at once (262k columns for Gemma 3).
It reads the parameters only: no cache, allocator or request is touched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Positions projected onto the vocabulary at a time.
CHUNK = 64


def prompt_logprobs(graphdef, params_def, top: int, params: list[jax.Array], tokens: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Under the model ``graphdef`` with ``params`` (the leaves of ``params_def``), for each position ``j``
    of ``tokens: i32[L]`` (``L`` a multiple of ``CHUNK``): the log-probability of ``tokens[j + 1]`` given
    ``tokens[:j + 1]`` (``f32[L]``; the last one scores token 0), and the ``top`` likeliest next tokens
    (``i32[L, top]``, likeliest first) with theirs (``f32[L, top]``). Padding after a prompt changes
    nothing at the prompt's positions: the forward is causal."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params))
    hidden = model.hidden(tokens)
    following = jnp.append(tokens[1:], 0)

    def project(chunk):
        h, nxt = chunk
        scores = model.logits(h).astype(jnp.float32)                        # [CHUNK, V]
        lse = jax.nn.logsumexp(scores, axis=-1)
        logprob = jnp.take_along_axis(scores, nxt[:, None], axis=-1)[:, 0] - lse
        values, ids = jax.lax.top_k(scores, top)
        return logprob, ids.astype(jnp.int32), values - lse[:, None]

    chunks = (hidden.reshape(-1, CHUNK, hidden.shape[-1]), following.reshape(-1, CHUNK))
    logprob, ids, values = jax.lax.map(project, chunks)
    length = tokens.shape[0]
    return logprob.reshape(length), ids.reshape(length, top), values.reshape(length, top)
