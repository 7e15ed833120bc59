"""Where each query token of a ragged batch belongs (``reference.py``'s docstring states the batch layout).

The kernels, their oracle and the engine's step all read these; they live apart from the oracle so that
code which is not an oracle need not import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_sequences(query_start_loc: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """``(seq, valid)`` per query token: its sequence index and whether it belongs to one."""
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")
    valid = (t >= query_start_loc[0]) & (seq < query_start_loc.shape[0] - 1)
    return jnp.minimum(seq, query_start_loc.shape[0] - 2).astype(jnp.int32), valid


def query_positions(query_start_loc: jax.Array, seq_lens: jax.Array,
                    num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(seq, position, valid)`` of every query token of a ragged batch."""
    seq, valid = token_sequences(query_start_loc, num_tokens)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + jnp.arange(num_tokens) - query_start_loc[seq]
    return seq, pos.astype(jnp.int32), valid
