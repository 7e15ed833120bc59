"""Splitting a ragged batch of query tokens into fixed-size work items.

A kernel program handles ``block_q`` query tokens of one sequence for one kv
head. The batch (``query_start_loc``) is cut into such items: sequence ``s``
gets ``ceil(q_len_s / block_q)`` of them. Queries are gathered into a dense
``[items, block_q, ...]`` array before the kernel and scattered back after, so
every program reads and writes whole tiles and no two programs write the same
row.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kernels_pallas.positions import token_sequences
from kernels_pallas.reference import AttentionParams


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class WorkItems:
    """The work items of one ragged batch (``I = ceil(T / block_q) + S`` slots, a static bound).

    ``seq: i32[I]``: the sequence of each item (``S`` for an unused slot);
    ``q_block: i32[I]``: which ``block_q`` rows of that sequence's queries;
    ``token_item, token_row: i32[T]``: where each query token sits in the items
    (``I`` for padding tokens); ``row_token: i32[I, block_q]``: the token in
    each item row (``T`` for a row without one).
    """

    seq: jax.Array
    q_block: jax.Array
    token_item: jax.Array
    token_row: jax.Array
    row_token: jax.Array


def work_items(query_start_loc: jax.Array, num_tokens: int, block_q: int, out_tokens: int | None = None) -> WorkItems:
    """Cut the ragged batch into work items of ``block_q`` query rows. ``token_item`` and ``token_row`` cover
    ``out_tokens`` (default ``num_tokens``) output rows: those past the batch's tokens are padding."""
    num_seqs = query_start_loc.shape[0] - 1
    n = cdiv(num_tokens, block_q) + num_seqs  # each sequence wastes at most one partial item
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    per_seq = (q_len + block_q - 1) // block_q
    ends = jnp.cumsum(per_seq)
    starts = ends - per_seq
    i = jnp.arange(n)
    seq = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    q_block = i - starts[jnp.minimum(seq, num_seqs - 1)]
    tseq, tvalid = token_sequences(query_start_loc, num_tokens if out_tokens is None else out_tokens)
    offset = jnp.arange(tseq.shape[0]) - query_start_loc[tseq]
    token_item = jnp.where(tvalid, starts[tseq] + offset // block_q, n)
    seq_c = jnp.minimum(seq, num_seqs - 1)
    token = (query_start_loc[seq_c] + q_block * block_q)[:, None] + jnp.arange(block_q)
    has_token = (seq < num_seqs)[:, None] & (token < query_start_loc[seq_c + 1][:, None])
    return WorkItems(seq, q_block.astype(jnp.int32), token_item.astype(jnp.int32),
                     (offset % block_q).astype(jnp.int32), jnp.where(has_token, token, num_tokens).astype(jnp.int32))


def gather_queries(q: jax.Array, items: WorkItems) -> jax.Array:
    """``q: [T, H, D]`` -> ``[I, block_q, H, D]`` (rows without a token are zero). A gather, each row
    reading its token: zeros and a scatter into them would be two kernels on a GPU, and a copy of the
    zeros per layer where XLA shares one zero array among the layers."""
    return q.at[items.row_token].get(mode="fill", fill_value=0)


def scatter_outputs(o_items: jax.Array, items: WorkItems) -> jax.Array:
    """``[I, block_q, H, D]`` -> ``[T, H, D]`` (padding tokens get zeros)."""
    return o_items.at[items.token_item, items.token_row].get(mode="fill", fill_value=0)


def first_visible_key(pos: jax.Array, params: AttentionParams) -> jax.Array:
    """First key position a query at ``pos`` may see (its window or chunk start; 0 for full attention)."""
    lo = jnp.zeros_like(pos)
    if params.sliding_window is not None:
        lo = jnp.maximum(lo, pos - params.sliding_window + 1)
    if params.chunk_size is not None:
        lo = jnp.maximum(lo, pos // params.chunk_size * params.chunk_size)
    return lo


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ItemBounds:
    """What each work item computes (``i32[I]`` each).

    ``seq``: its sequence (clamped to a valid index); ``p0``: position of its first
    query; ``n_rows``: its query tokens (0 for an unused slot); ``k_lo``: the first
    key any of its queries sees. Its queries see keys below ``p0 + n_rows``.
    """

    seq: jax.Array
    p0: jax.Array
    n_rows: jax.Array
    k_lo: jax.Array


def item_bounds(items: WorkItems, query_start_loc: jax.Array, seq_lens: jax.Array, block_q: int,
                params: AttentionParams) -> ItemBounds:
    """The query and key ranges of every work item."""
    num_seqs = seq_lens.shape[0]
    seq = jnp.minimum(items.seq, num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    first = items.q_block * block_q
    n_rows = jnp.where(items.seq < num_seqs, jnp.minimum(block_q, q_len - first), 0)
    p0 = seq_lens[seq] - q_len + first
    return ItemBounds(seq.astype(jnp.int32), p0.astype(jnp.int32), n_rows.astype(jnp.int32),
                      first_visible_key(p0, params).astype(jnp.int32))
