"""Ragged paged attention as a jnp loop over block-table columns with an online softmax (the CPU default).

``reference.paged_attention`` gathers, for every query token, every page of its
block table at once: simple, and the oracle, but a prefill chunk of T tokens
then copies its sequence's KV T times (gigabytes per step for a 128-token
chunk over 880 keys in 18 layers). Here the queries are cut into work items of
``block_q`` tokens of one sequence (``ragged.py``), and a ``fori_loop`` visits
a few columns of the block tables at a time: each item's pages of those columns
(``[I, C, 2, Hkv, block_size, D]``, read once for all ``block_q`` queries of
the item), their scores, and flash attention's
online-softmax update. The loop covers only the columns some valid query can
see (from the lowest first visible block, which a sliding window or chunk
raises, to the highest last one). GQA by grouping query heads; V rows no query
of an item sees are zeroed before use (NaN-safe). Same shapes and results as
the reference.

On XLA:CPU each iteration's 40-odd operations cost a few microseconds each
whatever their size, so a step over long sequences was mostly that overhead
(Gemma 3 270M, 55 columns, 18 layers: 60% of a 64-token step). Several columns
per iteration divide it: up to 8 (``COLUMNS``) took up to 55% less time than 1,
and never measurably more, from 8 decode queries to a 256-sequence batch over
2,048 keys (``benchmarks/attention_cpu.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import ragged
from kernels_pallas.positions import query_positions
from kernels_pallas.reference import AttentionParams, as_bits, from_bits, key_mask

PREFILL_BLOCK_Q = 16
COLUMNS = 8  # block-table columns per iteration (fewest us per layer on XLA:CPU, 1 to 256 sequences)


def default_block_q(num_tokens: int, num_seqs: int) -> int:
    """Queries per work item: 1 when the batch can be all decodes (every item one token, nothing
    padded), else ``PREFILL_BLOCK_Q`` (a chunk's page is then read once per 16 queries, at the price of
    at most one partly empty item per sequence)."""
    return 1 if num_tokens <= num_seqs else PREFILL_BLOCK_Q


@functools.partial(jax.jit, static_argnames=("params", "block_q", "columns"))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array, query_start_loc: jax.Array,
                    seq_lens: jax.Array, params: AttentionParams, sinks: jax.Array | None = None,
                    block_q: int | None = None, columns: int | None = None) -> jax.Array:
    """Ragged paged attention (shapes: ``kernels_pallas.reference``), ``columns`` block-table columns per
    iteration.

    ``block_q``: queries per work item (default: ``default_block_q``); ``columns`` (at most: default ``COLUMNS``;
    spread evenly, so that the last iteration pads the fewest null columns)."""
    num_tokens, hq, d = q.shape
    _, _, hkv, bs, _ = kv_pages.shape
    g = hq // hkv
    max_blocks = block_tables.shape[1]
    block_q = block_q or default_block_q(num_tokens, seq_lens.shape[0])
    if block_q == 1:  # an item per token (padding tokens included): no padding items
        seq, pos, valid = query_positions(query_start_loc, seq_lens, num_tokens)
        b = ragged.ItemBounds(seq, pos, valid.astype(jnp.int32), ragged.first_visible_key(pos, params))
        q_items, unpack = q[:, None], lambda out: jnp.where(valid[:, None, None], out[:, 0], 0.0)
    else:
        items = ragged.work_items(query_start_loc, num_tokens, block_q)
        b = ragged.item_bounds(items, query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32), block_q,
                               params)
        q_items, unpack = ragged.gather_queries(q, items), lambda out: ragged.scatter_outputs(out, items)
    n = b.seq.shape[0]
    row = jnp.arange(block_q)
    q_pos = b.p0[:, None] + row                                    # [I, bq]
    row_ok = row < b.n_rows[:, None]
    c = min(columns or COLUMNS, max_blocks)
    c = -(-max_blocks // -(-max_blocks // c))  # as many iterations, evenly filled: the least padding
    width = -(-max_blocks // c) * c  # the tables padded with null pages to whole iterations (masked)
    tables = jnp.pad(block_tables[b.seq], ((0, 0), (0, width - max_blocks)))          # [I, width]
    qg = q_items.reshape(n, block_q, hkv, g, d).astype(jnp.float32) * params.scale(d)
    lo = jnp.min(jnp.where(b.n_rows > 0, b.k_lo // bs, max_blocks)) // c
    hi = -(-jnp.minimum(jnp.max(jnp.where(b.n_rows > 0, (b.p0 + b.n_rows + bs - 1) // bs, 0)), max_blocks) // c)

    bits = as_bits(kv_pages)  # fp8 pages gathered as bytes (``reference.as_bits``)

    def visit(j, carry):
        m, l, acc = carry                                          # [I, bq, Hkv, G], same, [I, bq, Hkv, G, D]
        cols = jax.lax.dynamic_slice_in_dim(tables, j * c, c, axis=1)
        pages = from_bits(bits[cols], kv_pages.dtype).astype(jnp.float32)               # [I, c, 2, Hkv, bs, D]
        # keys of column ci, row r at ci * bs + r: s's last axis
        s = jnp.einsum("ibkgd,icknd->ibkgcn", qg, pages[:, :, 0]).reshape(n, block_q, hkv, g, c * bs)
        if params.soft_cap is not None:
            s = params.soft_cap * jnp.tanh(s / params.soft_cap)
        k_pos = j * c * bs + jnp.arange(c * bs)
        mask = key_mask(q_pos[:, :, None], k_pos, params) & row_ok[:, :, None]   # [I, bq, c * bs]
        seen = mask[:, :, None, None, :]
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - base)
        p = jnp.where(seen, jnp.exp(s - base[..., None]), 0.0)
        seen_v = mask.any(1).reshape(n, c, 1, bs, 1)
        v = jnp.where(seen_v, pages[:, :, 1], 0.0)                  # 0 * NaN would leak stale data
        acc = acc * alpha[..., None] + jnp.einsum("ibkgcn,icknd->ibkgd", p.reshape(*p.shape[:-1], c, bs), v)
        return m_new, l * alpha + p.sum(-1), acc

    shape = (n, block_q, hkv, g)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, visit, init)
    if sinks is not None:  # one extra logit per head in the denominator
        sink = sinks.reshape(hkv, g).astype(jnp.float32)
        top = jnp.maximum(m, sink)
        scale = jnp.exp(m - top)
        l, acc = l * scale + jnp.exp(sink - top), acc * scale[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return unpack(out.reshape(n, block_q, hq, d)).astype(q.dtype)
