"""The calls a recurrent (Mamba) layer makes: its per-request state, read from and written to the pages.

The allocator follows vLLM's 'align' mode: entry ``i`` of a request's table
in a Mamba group holds the state after ``(i + 1) * block_size`` tokens, so
the state after ``n`` computed tokens lives in entry ``cdiv(n, block_size) - 1``
(rewritten in place while ``n`` stays inside that block; once the block is
full it is cached and never written again). A sequence of a step that
computes positions ``[start, seq_len)`` therefore reads entry
``cdiv(start, bs) - 1`` (a zero state when ``start == 0``) and writes entry
``cdiv(seq_len, bs) - 1``. For that entry to mean what its hash says, a
chunk that starts inside a block must not run past the next block
boundary (``Engine`` trims such chunks). Under the ``min-waste`` planner a
state may span ``k`` pages; an entry is then ``k`` pages, listed together in
the step's block table (``Layout.config_tables``).

``ragged_scan`` runs a per-token cell over a ragged batch, each sequence
from its own state.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from hkv_jax.attention import AttentionMetadata
from hkv_jax.cache import KVCache, read_mamba_state, write_mamba_state
from hkv_jax.spec import MambaSpec
from kernels_pallas.reference import query_positions


def state_blocks(cache: KVCache, layer: str, metadata: AttentionMetadata):
    """``(src, dst, fresh, active)`` of Mamba ``layer`` for every sequence of the step.

    ``src, dst: i32[S, blocks_per_state]`` are the pages to read the state from and write it
    to; ``fresh: bool[S]`` marks sequences starting from the zero state;
    ``active: bool[S]`` those with at least one token in the step.
    """
    slot = cache.layout.slot(layer)
    if not isinstance(slot.spec, MambaSpec):
        raise TypeError(f"layer {layer!r} is not a Mamba layer")
    bs, k = slot.block_size, slot.blocks_per_state
    table = metadata.block_tables[slot.group_id]                       # [S, M * k]: entry i's pages at i*k..
    q_len = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    start = metadata.seq_lens - q_len

    def entry(n):
        idx = jnp.clip((n + bs - 1) // bs - 1, 0, table.shape[1] // k - 1)
        return jnp.take_along_axis(table, idx[:, None] * k + jnp.arange(k), axis=1)

    return entry(start), entry(metadata.seq_lens), start == 0, q_len > 0


def load_states(layer: str, cache: KVCache, metadata: AttentionMetadata) -> tuple[jax.Array, ...]:
    """The state tensors ``[S, *shape]`` each sequence of the step starts from (zeros for a fresh one)."""
    src, _, fresh, _ = state_blocks(cache, layer, metadata)
    return tuple(jnp.where(fresh.reshape(-1, *[1] * (s.ndim - 1)), jnp.zeros_like(s), s)
                 for s in read_mamba_state(cache, layer, src))


def store_states(layer: str, states, cache: KVCache, metadata: AttentionMetadata) -> KVCache:
    """Write each active sequence's final state (``load_states``' shapes) to its block."""
    _, dst, _, active = state_blocks(cache, layer, metadata)
    return write_mamba_state(cache, layer, dst, states, valid=active)


def ragged_scan(cell: Callable, states, xs, metadata: AttentionMetadata):
    """Run ``cell(state, x) -> (state, y)`` over the step's tokens in order, each token on its sequence's state.

    ``states``: a pytree with a leading ``[S]`` axis; ``xs``: a pytree with a
    leading ``[T]`` axis (padding tokens leave every state untouched).
    Returns ``(states, ys)`` with ``ys`` stacked over ``[T]``.
    """
    num_tokens = jax.tree.leaves(xs)[0].shape[0]
    seq, _, valid = query_positions(metadata.query_start_loc, metadata.seq_lens, num_tokens)

    def body(st, x):
        s, ok, xt = x
        cur = jax.tree.map(lambda a: a[s], st)
        new, y = cell(cur, xt)
        st = jax.tree.map(lambda a, n, c: a.at[s].set(jnp.where(ok, n, c)), st, new, cur)
        return st, y

    return jax.lax.scan(body, states, (seq, valid, xs))
