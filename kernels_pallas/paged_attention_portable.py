"""Ragged paged attention as a Pallas kernel (portable variant: Triton on GPU, interpret on CPU).

One program handles one work item (``block_q`` query tokens of one sequence,
see ``ragged.py``) for one kv head, i.e. ``block_q x G`` query rows. It walks
only the pages its rows can see: from the page of the first row's window (or
chunk) start to the page of its last row, so pages wholly outside a sliding
window or chunk are never read, and neither is the null block for a valid
position. Online softmax in f32; V rows past the valid key range are zeroed
before the product so that stale pages (NaN included) cannot leak.

Triton needs every tensor's size to be a power of 2, so the kernel works on
power-of-2 tiles of whatever the planner emits: the GQA group is padded to
the next power of 2 (zero query heads, dropped from the output), and a page
whose block size is not a power of 2 (80 or 528 tokens under the vllm policy
with Mamba layers) is read in slices of its largest power-of-2 divisor.
``supports`` names what remains out of reach (a head size that is not a
power of 2).

``page_step`` and ``finish`` hold the math shared with the Mosaic GPU variant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import ragged
from kernels_pallas.reference import AttentionParams, key_mask
from kernels_pallas.support import YES, Support, no

MASK_VALUE = -1e30


def pow2_at_least(n: int) -> int:
    """The smallest power of 2 that is ``>= n``."""
    return 1 << max(n - 1, 0).bit_length()


def pow2_tile(block_size: int) -> int:
    """Rows of a page read at once: the largest power of 2 dividing ``block_size``."""
    return block_size & -block_size


def supports(kv_pages_shape: tuple[int, ...], num_q_heads: int) -> Support:
    """Why this kernel cannot run the given shapes (``None`` when it can)."""
    _, two, hkv, _, d = kv_pages_shape
    if two != 2 or num_q_heads % hkv:
        return no(f"{num_q_heads} query heads do not fit kv_pages {tuple(kv_pages_shape)}")
    if d != pow2_at_least(d):
        return no(f"head_size {d} (Triton tiles need a power of 2)")
    return YES


def page_step(q, k, v, k_pos, row_pos, row_ok, k_lo, k_hi, carry, params: AttentionParams):
    """One page of online softmax.

    ``q: f32[R, D]`` (pre-scaled), ``k, v: [P, D]``, ``k_pos: i32[P]``,
    ``row_pos: i32[R]``, ``row_ok: bool[R]``; keys outside ``[k_lo, k_hi)`` are
    invalid. ``carry = (m f32[R], l f32[R], acc f32[R, D])``.
    """
    m, l, acc = carry
    key_ok = (k_pos >= k_lo) & (k_pos < k_hi)
    s = jax.lax.dot_general(q, k.astype(jnp.float32), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    if params.soft_cap is not None:
        s = params.soft_cap * jnp.tanh(s / params.soft_cap)
    mask = row_ok[:, None] & key_ok[None, :] & key_mask(row_pos[:, None], k_pos[None, :], params)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    v = jnp.where(key_ok[:, None], v.astype(jnp.float32), 0.0)
    acc = acc * alpha[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l * alpha + p.sum(axis=1), acc


def init_carry(rows: int, head_size: int):
    """The online-softmax state before the first page."""
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_size), jnp.float32))


def finish(carry, sinks: jax.Array | None) -> jax.Array:
    """``acc / l`` with the optional per-row sink logit in the denominator; rows that saw nothing give 0."""
    m, l, acc = carry
    if sinks is not None:
        m_fin = jnp.maximum(m, sinks)
        scale = jnp.exp(m - m_fin)
        l = l * scale + jnp.exp(sinks - m_fin)
        acc = acc * scale[:, None]
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def _kernel(bounds_ref, bt_ref, q_ref, kv_ref, *rest, params: AttentionParams, block_q: int,
            has_sinks: bool):
    sinks_ref, o_ref = (rest[0], rest[1]) if has_sinks else (None, rest[0])
    item, h = pl.program_id(0), pl.program_id(1)
    _, group, head_size = q_ref.shape
    rows = block_q * group
    bs = kv_ref.shape[3]
    tile = pow2_tile(bs)
    per_page = bs // tile
    seq, p0, n_rows, k_lo = (bounds_ref[item, c] for c in range(4))  # ragged.ItemBounds
    row = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    row_pos, row_ok = p0 + row, row < n_rows
    k_hi = p0 + n_rows
    q = q_ref[...].reshape(rows, head_size).astype(jnp.float32) * params.scale(head_size)
    k_iota = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)

    def body(j, carry):  # tile j: rows [j * tile, (j + 1) * tile) of the sequence
        page = bt_ref[seq, j // per_page]
        rows_at = pl.ds(pl.multiple_of((j % per_page) * tile, tile), tile)
        k = kv_ref[page, 0, h, rows_at]
        v = kv_ref[page, 1, h, rows_at]
        return page_step(q, k, v, j * tile + k_iota, row_pos, row_ok, k_lo, k_hi, carry, params)

    hi = jnp.where(n_rows > 0, (k_hi + tile - 1) // tile, 0)
    carry = jax.lax.fori_loop(k_lo // tile, hi, body, init_carry(rows, head_size))
    sinks = None
    if has_sinks:
        sinks = jnp.broadcast_to(sinks_ref[...].astype(jnp.float32)[None, :],
                                 (block_q, group)).reshape(rows)
    o_ref[...] = finish(carry, sinks).reshape(block_q, group, head_size).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("params", "block_q", "interpret"))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, params: AttentionParams,
                    sinks: jax.Array | None = None, *, block_q: int = 8,
                    interpret: bool = False) -> jax.Array:
    """Ragged paged attention (shapes: ``reference.py``) with the portable Pallas kernel.

    ``interpret=True`` runs it on CPU; on a GPU it lowers through Triton.
    ``block_q`` must be a power of 2. Raises ``ValueError`` for shapes the
    kernel does not take (``supports``).
    """
    num_tokens, hq, d = q.shape
    if kv_pages.ndim != 5 or kv_pages.shape[4] != d:
        raise ValueError(f"q {q.shape} does not fit kv_pages {kv_pages.shape}")
    support = supports(kv_pages.shape, hq)
    if not support or block_q != pow2_at_least(block_q):
        raise ValueError(f"portable paged attention does not take {support.reason or f'block_q {block_q}'}")
    hkv = kv_pages.shape[2]
    group = hq // hkv
    padded = pow2_at_least(group)  # zero query heads: block_q x padded rows per program
    items = ragged.work_items(query_start_loc, num_tokens, block_q)
    b = ragged.item_bounds(items, query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
                           block_q, params)
    bounds = jnp.stack([b.seq, b.p0, b.n_rows, b.k_lo], axis=1)          # i32[I, 4]
    n = items.seq.shape[0]
    q_items = ragged.gather_queries(q, items).reshape(n, block_q, hkv, group, d)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, 0), (0, padded - group), (0, 0)))
    def whole(shape):
        return pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
    q_tile = pl.BlockSpec((None, block_q, None, padded, d), lambda i, h: (i, 0, h, 0, 0))
    in_specs = [whole(bounds.shape), whole(block_tables.shape), q_tile, whole(kv_pages.shape)]
    args = [bounds, block_tables.astype(jnp.int32), q_items, kv_pages]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((None, padded), lambda i, h: (h, 0)))
        args.append(jnp.pad(sinks.reshape(hkv, group), ((0, 0), (0, padded - group))))
    kernel = functools.partial(_kernel, params=params, block_q=block_q, has_sinks=sinks is not None)
    o_items = pl.pallas_call(
        kernel,
        grid=(n, hkv),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct((n, block_q, hkv, padded, d), q.dtype),
        interpret=interpret,
        name="hkv_ragged_paged_attention",
    )(*args)
    return ragged.scatter_outputs(o_items[:, :, :, :group].reshape(n, block_q, hq, d), items)
