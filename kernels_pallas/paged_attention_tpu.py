"""Ragged paged attention as a Pallas TPU (Mosaic) kernel over the unified page buffers.

One program handles one work item (``block_q`` query tokens of one sequence, ``ragged.py``) for one kv
head: ``block_q x G`` query rows in VMEM. The pages stay in HBM (``pl.ANY``); the program walks the
pages its rows can see (from the page of the first row's window or chunk start to the page of its last
row), copying each page's K and V of its head, ``[2, block_size, head_size]``, into a VMEM double
buffer: page ``j + 1``'s DMA runs while page ``j`` is multiplied. Block tables and item bounds are
scalar-prefetched into SMEM, so the DMA addresses are known without a vector load. The math per page is
the portable kernel's (``page_step``, ``finish``): online softmax in f32, V rows outside the valid key
range zeroed (stale pages may hold NaN).

The page layout is the engine's (``[num_blocks, 2, num_kv_heads, block_size, head_size]``), read in
place: jax's bundled TPU ragged paged attention wants ``[pages, block, 2 * heads, head]`` and neither
chunked attention nor sinks, so it would need a copy of the pool per step.

Tested on CPU in TPU interpret mode (``interpret=True``), and lowered for TPU in CI; Mosaic's own
compile (layouts, VMEM) runs only on a TPU host and has not been run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import ragged
from kernels_pallas.paged_attention_portable import finish, init_carry, page_step
from kernels_pallas.reference import AttentionParams
from kernels_pallas.support import YES, Support, no

LANES = 128  # a TPU vector register is [8 * packing, 128]: the head size fills whole lanes


def supports(kv_pages_shape: tuple[int, ...], kv_dtype, num_q_heads: int) -> Support:
    """Why this kernel should not be compiled for a TPU at these shapes (``None`` when it can).

    Interpret mode runs any shape; on a TPU the head size must fill whole 128-lane vectors and a page's
    rows whole sublane tiles (8 rows of 32-bit words: 16 for bf16/fp16), so that each page's DMA and
    product work on unpadded tiles.
    """
    _, two, hkv, bs, d = kv_pages_shape
    if two != 2 or num_q_heads % hkv:
        return no(f"{num_q_heads} query heads do not fit kv_pages {tuple(kv_pages_shape)}")
    if d % LANES:
        return no(f"head_size {d} (TPU vectors are {LANES} lanes)")
    rows = 8 * (4 // jnp.dtype(kv_dtype).itemsize)
    if bs % rows:
        return no(f"block_size {bs} ({jnp.dtype(kv_dtype).name} pages need multiples of {rows} rows)")
    return YES


def _kernel(bounds_ref, tables_ref, q_ref, kv_hbm, *rest, params: AttentionParams, group: int,
            max_blocks: int, has_sinks: bool):
    sinks_ref, o_ref, buf, sem = rest if has_sinks else (None, *rest)
    item, h = pl.program_id(0), pl.program_id(1)
    rows, head_size = q_ref.shape
    bs = buf.shape[2]
    seq, p0, n_rows, k_lo = (bounds_ref[item * 4 + c] for c in range(4))  # ragged.ItemBounds
    row = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    row_pos, row_ok = p0 + row, row < n_rows
    k_hi = p0 + n_rows
    first = k_lo // bs
    last = jnp.where(n_rows > 0, (k_hi + bs - 1) // bs, first)
    q = q_ref[...].astype(jnp.float32) * params.scale(head_size)
    k_iota = jax.lax.broadcasted_iota(jnp.int32, (bs,), 0)

    def copy(j, slot):  # page j of the sequence, this head's K and V -> buf[slot]
        page = tables_ref[seq * max_blocks + j]
        return pltpu.make_async_copy(kv_hbm.at[page, :, h], buf.at[slot], sem.at[slot])

    @pl.when(first < last)
    def _():
        copy(first, 0).start()

    def body(j, carry):
        slot = (j - first) % 2

        @pl.when(j + 1 < last)
        def _():
            copy(j + 1, 1 - slot).start()

        copy(j, slot).wait()
        kv = buf[slot]
        return page_step(q, kv[0], kv[1], j * bs + k_iota, row_pos, row_ok, k_lo, k_hi, carry, params)

    carry = jax.lax.fori_loop(first, last, body, init_carry(rows, head_size))
    sinks = sinks_ref[...].astype(jnp.float32).reshape(rows) if has_sinks else None
    o_ref[...] = finish(carry, sinks).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("params", "block_q", "interpret"))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, params: AttentionParams,
                    sinks: jax.Array | None = None, *, block_q: int = 8,
                    interpret: bool = False) -> jax.Array:
    """Ragged paged attention (shapes: ``reference.py``) with the Pallas TPU kernel.

    ``interpret=True`` runs it on any backend (TPU interpret mode). Raises ``ValueError`` when q does
    not fit the pages; ``supports`` says which shapes a TPU should compile.
    """
    num_tokens, hq, d = q.shape
    if kv_pages.ndim != 5 or kv_pages.shape[1] != 2 or kv_pages.shape[4] != d or hq % kv_pages.shape[2]:
        raise ValueError(f"q {q.shape} does not fit kv_pages {kv_pages.shape}")
    _, _, hkv, bs, _ = kv_pages.shape
    group = hq // hkv
    rows = block_q * group
    max_blocks = block_tables.shape[1]
    items = ragged.work_items(query_start_loc, num_tokens, block_q)
    b = ragged.item_bounds(items, query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
                           block_q, params)
    n = items.seq.shape[0]
    # Each program's query rows as one [rows, D] tile: [I, block_q, Hkv, G, D] -> [I, Hkv, rows, D].
    q_items = ragged.gather_queries(q, items).reshape(n, block_q, hkv, group, d)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(n, hkv, rows, d)
    tile = pl.BlockSpec((None, None, rows, d), lambda i, h, *_: (i, h, 0, 0))
    in_specs = [tile, pl.BlockSpec(memory_space=pl.ANY)]
    args = [q_items, kv_pages]
    if sinks is not None:  # per row: its head's sink, [Hkv, 1, rows]
        per_row = jnp.broadcast_to(sinks.reshape(hkv, 1, 1, group), (hkv, 1, block_q, group))
        in_specs.append(pl.BlockSpec((None, 1, rows), lambda i, h, *_: (h, 0, 0)))
        args.append(per_row.reshape(hkv, 1, rows).astype(jnp.float32))
    bounds = jnp.stack([b.seq, b.p0, b.n_rows, b.k_lo], axis=1).reshape(-1)   # SMEM wants 1-D
    kernel = functools.partial(_kernel, params=params, group=group, max_blocks=max_blocks,
                               has_sinks=sinks is not None)
    o_items = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n, hkv),
            in_specs=in_specs,
            out_specs=tile,
            scratch_shapes=[pltpu.VMEM((2, 2, bs, d), kv_pages.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((n, hkv, rows, d), q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="hkv_ragged_paged_attention_tpu",
    )(bounds.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), *args)
    o_items = o_items.reshape(n, hkv, block_q, group, d).transpose(0, 2, 1, 3, 4)
    return ragged.scatter_outputs(o_items.reshape(n, block_q, hq, d), items)
