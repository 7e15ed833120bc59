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

Speculative decoding: a drafting sequence computes its last known token and
its drafts, and verification may keep only the first few. The engine keeps
its drafts inside the sequence's current block (``step._propose``), so the
state to keep goes to the same entry the step wrote. The layer records the
state after each of the step's first ``metadata.record_positions`` tokens
(``record``, an ``nnx.Intermediate`` on the layer), and once verification
decided, ``commit_accepted`` writes back the state after the accepted ones.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.attention import AttentionMetadata
from hkv_jax.cache import KVCache, read_mamba_state, write_mamba_state
from kernels_pallas.positions import query_positions


def state_blocks(cache: KVCache, layer: str, metadata: AttentionMetadata):
    """``(src, dst, fresh, active)`` of Mamba ``layer`` for every sequence of the step.

    ``src, dst: i32[S, blocks_per_state]`` are the pages to read the state from and write it
    to; ``fresh: bool[S]`` marks sequences starting from the zero state;
    ``active: bool[S]`` those with at least one token in the step.
    """
    slot = cache.layout.slot(layer)
    if not slot.spec.recurrent:
        raise TypeError(f"layer {layer!r} is not a Mamba layer")
    q_len, start = _step_span(metadata)
    return (state_entry(cache, layer, metadata, start), state_entry(cache, layer, metadata, metadata.seq_lens),
            start == 0, q_len > 0)


def _step_span(metadata: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """Each sequence's tokens in the step and the position it starts at: ``(q_len, start)``, ``i32[S]`` each."""
    q_len = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    return q_len, metadata.seq_lens - q_len


def state_entry(cache: KVCache, layer: str, metadata: AttentionMetadata, n: jax.Array) -> jax.Array:
    """The pages ``i32[S, blocks_per_state]`` of the entry holding each sequence's state after ``n: i32[S]``
    tokens (entry ``cdiv(n, block_size) - 1``)."""
    slot = cache.layout.slot(layer)
    bs, k = slot.block_size, slot.blocks_per_state
    table = metadata.block_tables[slot.group_id]                       # [S, M * k]: entry i's pages at i*k..
    idx = jnp.clip((n + bs - 1) // bs - 1, 0, table.shape[1] // k - 1)
    return jnp.take_along_axis(table, idx[:, None] * k + jnp.arange(k), axis=1)


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
    Returns ``(states, ys, recorded)`` with ``ys`` stacked over ``[T]`` and ``recorded``: with
    ``P = metadata.record_positions > 0``, ``states``' tree with ``[S, P]`` leading axes, the state
    after each of each sequence's first ``P`` tokens (``None`` when ``P == 0``).
    """
    num_tokens = jax.tree.leaves(xs)[0].shape[0]
    P = metadata.record_positions
    seq, _, valid = query_positions(metadata.query_start_loc, metadata.seq_lens, num_tokens)
    offset = jnp.arange(num_tokens) - metadata.query_start_loc[seq]     # the token's index in its sequence
    recorded = None if not P else jax.tree.map(lambda a: jnp.zeros((a.shape[0], P, *a.shape[1:]), a.dtype), states)

    def body(carry, x):
        st, rec = carry
        s, o, ok, xt = x
        cur = jax.tree.map(lambda a: a[s], st)
        new, y = cell(cur, xt)
        # States stored in a narrower dtype than the cell computes in (a bf16 cache) are rounded each token.
        st = jax.tree.map(lambda a, n, c: a.at[s].set(jnp.where(ok, n, c).astype(a.dtype)), st, new, cur)
        if P:  # an index past P (or a padding token) is dropped
            at = jnp.where(ok & (o < P), o, P)
            rec = jax.tree.map(lambda r, n: r.at[s, at].set(n.astype(r.dtype), mode="drop"), rec, new)
        return (st, rec), y

    (states, recorded), ys = jax.lax.scan(body, (states, recorded), (seq, offset, valid, xs))
    return states, ys, recorded


class RecordedStates(nnx.Intermediate):
    """A recurrent layer's ``ragged_scan`` record in a speculative step (``layer``: its cache name)."""


def record(module: nnx.Module, layer: str, recorded) -> None:
    """Keep ``ragged_scan``'s record of Mamba ``layer`` on ``module`` (nothing when it recorded nothing)."""
    if recorded is not None:
        module.recorded_states = RecordedStates(recorded, layer=layer)


def commit_accepted(model: nnx.Module, cache: KVCache, metadata: AttentionMetadata, keep: jax.Array) -> KVCache:
    """After verification: write each sequence's state after its first ``keep: i32[S]`` tokens of the step
    (from the records ``record`` left in ``model``) to the entry for ``start + keep`` tokens, where
    ``0 < keep <`` the tokens it computed (elsewhere the state the step wrote is already the right one)."""
    q_len, start = _step_span(metadata)
    rewind = (keep > 0) & (keep < q_len)
    at = jnp.clip(keep - 1, 0, metadata.record_positions - 1)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, RecordedStates):
            states = jax.tree.map(lambda r: jnp.take_along_axis(r, at.reshape(-1, *[1] * (r.ndim - 1)), axis=1)[:, 0],
                                  node.get_value())
            dst = state_entry(cache, node.layer, metadata, start + keep)
            cache = write_mamba_state(cache, node.layer, dst, states, valid=rewind)
    return cache
