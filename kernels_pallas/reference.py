"""Pure-jnp paged attention and KV write: the oracle of every kernel.

Shapes and conventions shared by all kernels of this package:

- ``q: [T, num_q_heads, head_size]``: the query tokens of all sequences of the
  batch, one after the other (ragged: a decode sequence has 1, a prefill chunk
  many); tokens past ``query_start_loc[-1]`` are padding and get zeros.
- ``kv_pages: [num_blocks, 2, num_kv_heads, block_size, head_size]``: a layer's
  page view (``hkv_jax.cache.layer_kv``), K at index 0 and V at 1.
- ``block_tables: i32[S, max_blocks]``: per sequence, the pages of its group.
- ``query_start_loc: i32[S + 1]``: sequence ``s`` owns query tokens
  ``[query_start_loc[s], query_start_loc[s + 1])``; an unused sequence slot
  has an empty range.
- ``seq_lens: i32[S]``: tokens in KV after this step's write (cached + new); the
  queries of sequence ``s`` sit at the last ``q_len`` positions.

Query heads ``h * G .. h * G + G - 1`` share kv head ``h`` (GQA, ``G`` =
num_q_heads / num_kv_heads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kernels_pallas.positions import query_positions


@dataclass(frozen=True)
class AttentionParams:
    """Static attention options of one layer.

    ``sliding_window``: a query sees itself and ``sliding_window - 1`` earlier
    keys. ``chunk_size``: a query sees keys of its own aligned chunk (Llama 4
    chunked local attention). ``soft_cap``: logits become ``cap * tanh(logits /
    cap)`` (Gemma 2). ``sm_scale`` defaults to ``head_size ** -0.5``.
    """

    sm_scale: float | None = None
    sliding_window: int | None = None
    chunk_size: int | None = None
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        for name in ("sliding_window", "chunk_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"soft_cap must be positive or None, got {self.soft_cap!r}")

    def scale(self, head_size: int) -> float:
        """The softmax scale for ``head_size``."""
        return self.sm_scale if self.sm_scale is not None else head_size ** -0.5


def key_mask(q_pos: jax.Array, k_pos: jax.Array, params: AttentionParams) -> jax.Array:
    """Which keys each query may see: causal, and inside its window or chunk (broadcasting)."""
    ok = k_pos <= q_pos
    if params.sliding_window is not None:
        ok &= q_pos - k_pos < params.sliding_window
    if params.chunk_size is not None:
        ok &= k_pos // params.chunk_size == q_pos // params.chunk_size
    return ok


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, params: AttentionParams,
                      sinks: jax.Array | None) -> jax.Array:
    """``softmax(q k^T) v`` over the keys each query may see, with GQA by grouping (no repeated K/V).

    ``q: [..., Hq, D]``, ``k, v: [..., K, Hkv, D]``, ``mask: bool[..., K]`` (masked rows of ``v`` may hold
    anything, NaN included). ``sinks: f32[Hq]`` adds one extra logit per head to the denominator
    (gpt-oss). A query that sees no key gets zeros. Returns ``f32[..., Hq, D]``.
    """
    hq, d = q.shape[-2:]
    hkv = k.shape[-2]
    qg = q.reshape(*q.shape[:-2], hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("...kgd,...nkd->...kgn", qg, k.astype(jnp.float32)) * params.scale(d)
    if params.soft_cap is not None:
        s = params.soft_cap * jnp.tanh(s / params.soft_cap)
    seen = mask[..., None, None, :]
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sinks = sinks.reshape(hkv, hq // hkv, 1).astype(jnp.float32)
        m = jnp.maximum(m, sinks)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(seen, jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m)
    v = jnp.where(mask[..., None, None], v, 0)  # 0 * NaN would leak stale data
    out = jnp.einsum("...kgn,...nkd->...kgd", p, v.astype(jnp.float32)) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(*q.shape[:-2], hq, d)


@functools.partial(jax.jit, static_argnames=("params",))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, params: AttentionParams,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Ragged paged attention (module docstring for the shapes), dense in jnp.

    Gathers every sequence's pages, so it reads the whole table even where a
    window would skip pages; masked positions (the null block, stale data
    past ``seq_lens``) never reach the output.
    """
    num_tokens, hq, d = q.shape
    _, _, hkv, bs, _ = kv_pages.shape
    seq, q_pos, valid = query_positions(query_start_loc, seq_lens, num_tokens)
    pages = from_bits(as_bits(kv_pages)[block_tables[seq]], kv_pages.dtype)  # [T, M, 2, Hkv, bs, D]
    pages = jnp.moveaxis(pages, 4, 2).reshape(num_tokens, -1, 2, hkv, d)  # [T, M*bs, 2, Hkv, D]
    k_pos = jnp.arange(pages.shape[1])[None, :]
    mask = key_mask(q_pos[:, None], k_pos, params) & valid[:, None] & (k_pos < seq_lens[seq][:, None])
    return grouped_attention(q, pages[:, :, 0], pages[:, :, 1], mask, params, sinks).astype(q.dtype)


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is a one-byte float (fp8 pages: e4m3, e5m2)."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_page_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` cast to a KV page dtype. fp8 saturates: a value past the format's largest finite one (448 in
    e4m3, where the plain cast gives NaN; 57,344 in e5m2, where it gives inf) is stored as that value, so
    one large K/V entry cannot poison every later score of its page."""
    if is_fp8(dtype):
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def as_bits(x: jax.Array) -> jax.Array:
    """An fp8 array viewed as ``uint8`` (other dtypes as they are), for gathers and scatters over pages: XLA:CPU
    has no fp8 gather or scatter and converts a whole fp8 operand, the pool, to f16 and back at every call."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if is_fp8(x.dtype) else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """``as_bits``' inverse: ``x`` back in the pages' ``dtype``."""
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


@jax.jit
def kv_write(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Store ``k, v: [T, Hkv, D]`` at ``slots: i32[T]`` (``page * block_size + offset``; -1 skips)."""
    n, _, _, bs, _ = kv_pages.shape
    page = jnp.where(slots >= 0, slots // bs, n)  # out of range: dropped
    off = jnp.where(slots >= 0, slots % bs, 0)
    kv = to_page_dtype(jnp.stack([k, v], axis=1), kv_pages.dtype)  # [T, 2, Hkv, D]
    return from_bits(as_bits(kv_pages).at[page, :, :, off].set(as_bits(kv), mode="drop"), kv_pages.dtype)
