"""Ragged paged attention for Hopper GPUs with Pallas Mosaic GPU (``plgpu.kernel``).

Same contract as ``paged_attention_portable.py``; one warpgroup per (work item, kv
head) with 64 query rows (``64 / G`` query tokens x ``G`` heads), so that both
products run on the tensor cores (``wgmma``):

1. TMA copies of the item's metadata (row positions, first visible key of each
   row), its block-table row and its Q tile into shared memory;
2. a loop over the visible pages only, double-buffered: the TMA copy of page
   ``j + 1`` (K and V of one kv head, ``[block_size, head_size]`` each) is in
   flight while page ``j`` is computed: ``S = Q K^T`` (wgmma), mask, online
   softmax in registers, ``O += P V`` (wgmma);
3. ``O / l`` (with the sink) back to global memory.

Limits (the dispatcher uses the portable kernel otherwise): bf16 or fp16 KV,
``block_size`` a multiple of 16, ``head_size`` a multiple of 64, ``G`` dividing
64. Unlike the portable kernel, V rows of a visible page that no query may
see are not zeroed before ``P V``: they must be finite, which holds for a
zero-initialised cache written only with finite K/V (pages no query sees,
the null block included, are never read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import ragged
from kernels_pallas.paged_attention_portable import MASK_VALUE
from kernels_pallas.reference import AttentionParams

ROWS = 64  # query rows per warpgroup: the wgmma M dimension

# Item metadata columns (i32[I, META]).
_SEQ, _PAGE_LO, _PAGE_HI, META = range(4)


def supported(q_dtype, kv_pages_shape: tuple[int, ...], kv_dtype, num_q_heads: int) -> str | None:
    """Why this kernel cannot run the given shapes (``None`` when it can)."""
    _, _, hkv, bs, d = kv_pages_shape
    if jnp.dtype(kv_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"KV dtype {jnp.dtype(kv_dtype).name} (bf16/fp16 only)"
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        return "q and KV dtypes differ"
    if bs % 16:
        return f"block_size {bs} (a multiple of 16 needed)"
    if d % 64:
        return f"head_size {d} (a multiple of 64 needed)"
    if num_q_heads % hkv or ROWS % (num_q_heads // hkv):
        return f"GQA group {num_q_heads // max(hkv, 1)} does not divide {ROWS}"
    return None


def _item_metadata(items: ragged.WorkItems, query_start_loc, seq_lens, block_q, bs,
                   params: AttentionParams, group: int):
    """Per item: scalars ``i32[I, META]`` and per-row ``i32[I, 2, ROWS]`` (position, first visible key)."""
    b = ragged.item_bounds(items, query_start_loc, seq_lens, block_q, params)
    k_hi = b.p0 + b.n_rows
    page_hi = jnp.where(b.n_rows > 0, (k_hi + bs - 1) // bs, 0)
    scalars = jnp.stack([b.seq, b.k_lo // bs, page_hi], axis=1).astype(jnp.int32)
    row = jnp.arange(ROWS) // group
    pos = b.p0[:, None] + row[None, :]
    ok = row[None, :] < b.n_rows[:, None]
    # First key each row sees: the mask of reference.key_mask as a lower bound.
    row_lo = ragged.first_visible_key(pos, params)
    rows = jnp.stack([jnp.where(ok, pos, -1), jnp.where(ok, row_lo, 0)], axis=1).astype(jnp.int32)
    return scalars, rows


def _kernel(*refs, params: AttentionParams, scale: float, has_sinks: bool):
    if has_sinks:
        meta_ref, rows_ref, bt_ref, q_ref, kv_ref, sinks_ref, *refs = refs
    else:
        (meta_ref, rows_ref, bt_ref, q_ref, kv_ref, *refs), sinks_ref = refs, None
    o_ref, meta_smem, rows_smem, bt_smem, q_smem, k_smem, v_smem, p_smem, sink_smem, bars, k_bars, v_bars = refs
    item, h = jax.lax.axis_index("item"), jax.lax.axis_index("head")
    bs, d = k_smem.shape[1], k_smem.shape[2]
    plgpu.copy_gmem_to_smem(meta_ref.at[item], meta_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(rows_ref.at[item], rows_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(q_ref.at[item, h], q_smem, bars.at[2])
    if has_sinks:
        plgpu.copy_gmem_to_smem(sinks_ref.at[h], sink_smem, bars.at[4])
        plgpu.barrier_wait(bars.at[4])
    plgpu.barrier_wait(bars.at[0])
    seq, page_lo, page_hi = meta_smem[_SEQ], meta_smem[_PAGE_LO], meta_smem[_PAGE_HI]
    plgpu.copy_gmem_to_smem(bt_ref.at[seq], bt_smem, bars.at[3])
    plgpu.barrier_wait(bars.at[1])
    plgpu.barrier_wait(bars.at[2])
    plgpu.barrier_wait(bars.at[3])

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    row_pos = plgpu.load(rows_smem.at[0], layout=row_layout)
    row_lo = plgpu.load(rows_smem.at[1], layout=row_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, bs), 1, layout=plgpu.Layout.WGMMA)

    def fetch(j, slot):
        page = bt_smem[j]
        plgpu.copy_gmem_to_smem(kv_ref.at[page, 0, h], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(kv_ref.at[page, 1, h], v_smem.at[slot], v_bars.at[slot])

    @pl.when(page_lo < page_hi)
    def _():
        fetch(page_lo, 0)

    def body(j, carry):
        acc, m, l = carry
        slot = jax.lax.rem(j - page_lo, 2)

        @pl.when(j + 1 < page_hi)
        def _():
            fetch(j + 1, 1 - slot)

        plgpu.barrier_wait(k_bars.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, bs), jnp.float32)) * scale
        if params.soft_cap is not None:
            s = params.soft_cap * jnp.tanh(s / params.soft_cap)
        k_pos = col + j * bs
        pos_b = jax.lax.broadcast_in_dim(row_pos, (ROWS, bs), [0])
        lo_b = jax.lax.broadcast_in_dim(row_lo, (ROWS, bs), [0])
        mask = (k_pos <= pos_b) & (k_pos >= lo_b)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_bars.at[slot])

        # P goes through shared memory and into a fresh accumulator: the Mosaic GPU
        # interpreter takes wgmma operands from refs only (registers would save a trip).
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
        return acc, m_new, l

    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout),
    )
    acc, m, l = jax.lax.fori_loop(page_lo, page_hi, body, init)
    if has_sinks:
        sink = plgpu.load(sink_smem, layout=row_layout)
        m_fin = jnp.maximum(m, sink)
        corr = jnp.exp(m - m_fin)
        l = l * corr + jnp.exp(sink - m_fin)
        acc = acc * jax.lax.broadcast_in_dim(corr, acc.shape, [0])
    l = jnp.where(l > 0, l, 1.0)
    q_smem[...] = (acc / jax.lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[item, h])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, params: AttentionParams,
                    sinks: jax.Array | None = None, *, interpret: bool = False) -> jax.Array:
    """Ragged paged attention (shapes: ``reference.py``) with the Mosaic GPU kernel.

    ``interpret=True`` runs it in Mosaic GPU's interpreter on CPU. Raises
    ``ValueError`` for shapes the kernel does not take (``supported``).
    """
    num_tokens, hq, d = q.shape
    _, _, hkv, bs, _ = kv_pages.shape
    why = supported(q.dtype, kv_pages.shape, kv_pages.dtype, hq)
    if why:
        raise ValueError(f"Mosaic GPU paged attention does not take {why}")
    group = hq // hkv
    block_q = ROWS // group
    items = ragged.work_items(query_start_loc, num_tokens, block_q)
    n = items.seq.shape[0]
    scalars, rows = _item_metadata(items, query_start_loc.astype(jnp.int32),
                                   seq_lens.astype(jnp.int32), block_q, bs, params, group)
    # [I, block_q, Hkv, G, D] -> [I, Hkv, ROWS, D]: one contiguous Q tile per program.
    q_items = ragged.gather_queries(q, items, block_q).reshape(n, block_q, hkv, group, d)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(n, hkv, ROWS, d)
    # TMA copies move multiples of 16 bytes: pad the table rows to 4 entries.
    max_blocks = block_tables.shape[1]
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, -max_blocks % 4)))
    sinks_rows = None
    if sinks is not None:
        sinks_rows = jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, 1, group), block_q, axis=1)
        sinks_rows = sinks_rows.reshape(hkv, ROWS)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    p_swizzle = min(128, bs * kv_pages.dtype.itemsize)  # P's rows are block_size wide
    p_tiled = (plgpu.TilingTransform((8, p_swizzle // kv_pages.dtype.itemsize)),
               plgpu.SwizzleTransform(p_swizzle))
    kernel = plgpu.kernel(
        functools.partial(_kernel, params=params, scale=params.scale(d), has_sinks=sinks is not None),
        out_type=jax.ShapeDtypeStruct((n, hkv, ROWS, d), q.dtype),
        scratch_types=[
            plgpu.SMEM((8,), jnp.int32),
            plgpu.SMEM((2, ROWS), jnp.int32),
            plgpu.SMEM((bt.shape[1],), jnp.int32),
            plgpu.SMEM((ROWS, d), q.dtype, transforms=tiled),
            plgpu.SMEM((2, bs, d), kv_pages.dtype, transforms=tiled),
            plgpu.SMEM((2, bs, d), kv_pages.dtype, transforms=tiled),
            plgpu.SMEM((ROWS, bs), kv_pages.dtype, transforms=p_tiled),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(num_barriers=5),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(n, hkv),
        grid_names=("item", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    meta = jnp.pad(scalars, ((0, 0), (0, 8 - META)))  # 32-byte rows for TMA
    extra = () if sinks_rows is None else (sinks_rows,)
    o = kernel(meta, rows, bt, q_items, kv_pages, *extra)
    o = o.reshape(n, hkv, block_q, group, d).transpose(0, 2, 1, 3, 4).reshape(n, block_q, hq, d)
    return ragged.scatter_outputs(o, items)
