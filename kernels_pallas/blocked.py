"""Ragged paged attention as a jnp loop over block-table columns with an online softmax (the CPU default).

``reference.paged_attention`` gathers, for every query token, every page of its
block table at once: simple, and the oracle, but a prefill chunk of T tokens
then copies its sequence's KV T times (gigabytes per step for a 128-token
chunk over 880 keys in 18 layers). Here a ``fori_loop`` visits one column of
the block tables at a time: each token's page of that column
(``[T, 2, Hkv, block_size, D]``, small enough to stay in cache), its scores,
and flash attention's online-softmax update. The loop covers only the columns
some valid token can see (from the lowest first visible block, which a
sliding window or chunk raises, to the highest last one). GQA by grouping
query heads; masked V rows are zeroed before use (NaN-safe). Same shapes and
results as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.ragged import first_visible_key
from kernels_pallas.reference import AttentionParams, key_mask, query_positions


@functools.partial(jax.jit, static_argnames=("params",))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array, query_start_loc: jax.Array,
                    seq_lens: jax.Array, params: AttentionParams, sinks: jax.Array | None = None) -> jax.Array:
    """Ragged paged attention (shapes: ``kernels_pallas.reference``), one block-table column per iteration."""
    num_tokens, hq, d = q.shape
    _, _, hkv, bs, _ = kv_pages.shape
    g = hq // hkv
    max_blocks = block_tables.shape[1]
    seq, q_pos, valid = query_positions(query_start_loc, seq_lens, num_tokens)
    tables = block_tables[seq]                                     # [T, M]
    lens = seq_lens[seq]
    qg = q.reshape(num_tokens, hkv, g, d).astype(jnp.float32) * params.scale(d)
    lo = jnp.min(jnp.where(valid, first_visible_key(q_pos, params) // bs, max_blocks))
    hi = jnp.minimum(jnp.max(jnp.where(valid, q_pos // bs + 1, 0)), max_blocks)

    def column(j, carry):
        m, l, acc = carry                                          # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        page = kv_pages[tables[:, j]].astype(jnp.float32)          # [T, 2, Hkv, bs, D]
        s = jnp.einsum("tkgd,tknd->tkgn", qg, page[:, 0])
        if params.soft_cap is not None:
            s = params.soft_cap * jnp.tanh(s / params.soft_cap)
        k_pos = j * bs + jnp.arange(bs)[None, :]
        mask = key_mask(q_pos[:, None], k_pos, params) & valid[:, None] & (k_pos < lens[:, None])  # [T, bs]
        seen = mask[:, None, None, :]
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - base)
        p = jnp.where(seen, jnp.exp(s - base[..., None]), 0.0)
        v = jnp.where(mask[:, None, :, None], page[:, 1], 0.0)    # 0 * NaN would leak stale data
        acc = acc * alpha[..., None] + jnp.einsum("tkgn,tknd->tkgd", p, v)
        return m_new, l * alpha + p.sum(-1), acc

    init = (jnp.full((num_tokens, hkv, g), -jnp.inf, jnp.float32), jnp.zeros((num_tokens, hkv, g), jnp.float32),
            jnp.zeros((num_tokens, hkv, g, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, column, init)
    if sinks is not None:  # one extra logit per head in the denominator
        sink = sinks.reshape(hkv, g).astype(jnp.float32)[None]
        top = jnp.maximum(m, sink)
        scale = jnp.exp(m - top)
        l, acc = l * scale + jnp.exp(sink - top), acc * scale[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(valid[:, None, None], out.reshape(num_tokens, hq, d), 0.0).astype(q.dtype)
