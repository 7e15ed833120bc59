"""Ragged paged attention for Hopper GPUs with Pallas Mosaic GPU (``plgpu.kernel``).

Same contract as ``paged_attention_portable.py``; one warpgroup per (work item, kv
head) with 64 query rows (``64 / G`` query tokens x ``G`` heads), so that both
products run on the tensor cores (``wgmma``):

1. TMA copies of the item's metadata (row positions, first visible key of each
   row), its block-table row and its Q tile into shared memory;
2. a loop over 64-key tiles of the visible keys, double-buffered: the TMA
   copies of tile ``t + 1`` are in flight while tile ``t`` is computed:
   ``S = Q K^T`` (wgmma), mask, online softmax in registers, ``O += P V``
   (wgmma);
3. ``O / l`` (with the sink) back to global memory.

Split over the context (flash-decoding): with ``splits > 1`` the grid gets a
third axis, and program ``s`` walks only the ``s``-th of ``splits`` equal runs
of its item's tiles. It writes its own normalised output (in q's dtype) and the
log of its softmax denominator (``m + log l``, f32); ``split_combine`` then weighs
each token's runs by their denominators (and the sink) in one Pallas kernel. One decode
sequence has ``Hkv`` programs without a split: 8 of an H200's 132 SMs busy,
each walking the whole context. ``default_splits`` fills the SMs, with at
most one run per tile an item can reach: a sliding window's or a chunk's
tiles, not its table's (``item_keys``), so that no program runs empty.

Prefill (``warpgroups=2``): two warpgroups per program, each with its own 64 query
rows of a 128-row item, walk the same K/V tiles: warpgroup 0 issues the copies
(and zeroes an edge tile's stale V rows, the other waiting on ``v_zeroed``), and a
tile's slot is refilled once both have arrived on its ``consumed`` barrier.
Each K/V tile then feeds twice the rows, so a prefill reads half the tiles into
shared memory per query row (FlashAttention-2/3 give a program 128 query rows for
the same reason). ``default_warpgroups`` picks 2 where a batch's sequences have
enough query tokens to fill such items and the shared memory holds them; decode
steps keep one.

A tile is 64 keys whatever the block size: ``P`` then has 128-byte rows, the
swizzle the P.V wgmma needs (16- and 32-token pages gave 32- and 64-byte rows,
which Mosaic GPU cannot lay out). A tile is filled by ``64 / chunk`` copies of
``chunk = gcd(block_size, 64)`` rows, so any block size that is a multiple of 16
works (80, 528 and 544 under the vllm policy with Mamba layers).

Stale memory: a tile's keys outside the item's visible range (before the window,
past the last position, or pages shared with Mamba states) may hold any bits,
NaN and Inf included. Their scores are masked, and their V rows are zeroed in
shared memory before ``P V`` (only the first and last tile can hold them).

fp8 pages (e4m3 or e5m2): the tensor cores multiply in bf16 (``compute_dtype``). Each
K/V tile is copied into shared memory as fp8 (half the bytes of a bf16 page), then
read into registers, converted (through f32: this ptxas converts fp8 to f16 only)
and stored as a bf16 tile for the wgmma; the V tile's rows outside the visible
range are zeroed in that pass.

Limits (``supports``; the dispatcher falls back to the portable kernel): bf16,
fp16 or fp8 KV, q in ``compute_dtype`` of it, ``block_size`` a multiple of 16, ``head_size`` a
multiple of 64, ``G`` dividing 64, a table of at most 16,384 columns, shared memory within an
H100/H200's 227 KiB.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import ragged, split_combine
from kernels_pallas.paged_attention_portable import MASK_VALUE
from kernels_pallas.reference import AttentionParams, is_fp8
from kernels_pallas.support import YES, Support, no

ROWS = 64  # query rows per warpgroup: the wgmma M dimension
KEYS = 64  # keys per loop iteration: P's rows are 128 bytes in bf16/fp16
SMEM_BYTES = 232448  # an H100/H200 block's shared memory (227 KiB)
# What Mosaic GPU's own count adds to the buffers' sizes (barriers, each swizzled buffer aligned): 3.7 to
# 5.2 KiB for every head size, page dtype, table width and warpgroup count (its lowering refuses a kernel
# past SMEM_BYTES, and says by how much).
SMEM_ALIGNMENT = 6 * 1024
HOPPER_SMS = 132  # an H100 SXM's or H200's streaming multiprocessors, where the device does not say
MAX_SPLITS = 32  # more runs than this add partial outputs faster than they shorten a run
FILL = 0.9  # two-warpgroup programs (one an SM) must keep this share of the SMs busy


def _max_warpgroups() -> int:
    """``HKV_MOSAIC_WARPGROUPS=1`` keeps ``default_warpgroups`` at one warpgroup a program (``gpu_session.sh``
    sets it for its later steps on a GPU where the two-warpgroup form failed its check)."""
    value = os.environ.get("HKV_MOSAIC_WARPGROUPS", "2")
    if value not in ("1", "2"):
        raise ValueError(f"HKV_MOSAIC_WARPGROUPS must be 1 or 2, got {value!r}")
    return int(value)


MAX_WARPGROUPS = _max_warpgroups()
# A block-table row sits in shared memory as [rows, TABLE_COLS]: one TMA copy moves at most 256 entries
# along each dimension, and a long context's row is longer than that.
TABLE_COLS = 64
MAX_TABLE_ROWS = 256

# Item metadata columns (i32[I, META]): the sequence, the visible keys [key_lo, key_hi).
_SEQ, _KEY_LO, _KEY_HI, META = range(4)


HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def compute_dtype(kv_dtype):
    """The dtype the tensor cores multiply in over pages of ``kv_dtype``: its own for bf16/fp16, bf16 for fp8."""
    return jnp.dtype(jnp.bfloat16) if is_fp8(kv_dtype) else jnp.dtype(kv_dtype)


def smem_bytes(head_size: int, max_blocks: int, kv_itemsize: int = 2, warpgroups: int = 1) -> int:
    """Shared memory the kernel takes: per warpgroup its Q tile, P and row metadata (and bf16 copies of the
    K and V tiles over fp8 pages); the double-buffered K and V tiles, the table row and the item's scalars."""
    own = (ROWS * 2 + (4 * KEYS if kv_itemsize == 1 else 0)) * head_size + ROWS * KEYS * 2 + 4 * 3 * ROWS
    shared = 4 * KEYS * kv_itemsize * head_size + 4 * _table_rows(max_blocks) * TABLE_COLS + 4 * 8
    return warpgroups * own + shared + SMEM_ALIGNMENT


def _table_rows(max_blocks: int) -> int:
    return max(1, -(-max_blocks // TABLE_COLS))


def supports(q_dtype, kv_pages_shape: tuple[int, ...], kv_dtype, num_q_heads: int,
              max_blocks: int = 0) -> Support:
    """Why this kernel cannot run the given shapes (``None`` when it can); ``max_blocks``: the
    block table's width (its row sits in shared memory)."""
    _, _, hkv, bs, d = kv_pages_shape
    if not (jnp.dtype(kv_dtype) in HALF or is_fp8(kv_dtype)):
        return no(f"KV dtype {jnp.dtype(kv_dtype).name} (bf16, fp16 or fp8 only)")
    if jnp.dtype(q_dtype) != compute_dtype(kv_dtype):
        return no(f"q dtype {jnp.dtype(q_dtype).name} over {jnp.dtype(kv_dtype).name} pages "
                  f"({compute_dtype(kv_dtype).name} needed)")
    if bs % 16:
        return no(f"block_size {bs} (a multiple of 16 needed)")
    if d % 64:
        return no(f"head_size {d} (a multiple of 64 needed)")
    if num_q_heads % hkv or ROWS % (num_q_heads // hkv):
        return no(f"GQA group {num_q_heads // max(hkv, 1)} does not divide {ROWS}")
    if _table_rows(max_blocks) > MAX_TABLE_ROWS:
        return no(f"{max_blocks} table columns (at most {MAX_TABLE_ROWS * TABLE_COLS:,})")
    need = smem_bytes(d, max_blocks, jnp.dtype(kv_dtype).itemsize)
    if need > SMEM_BYTES:
        return no(f"head_size {d} with {max_blocks} table columns ({need} bytes of shared memory)")
    return YES


def item_keys(table_keys: int, rows: int, params: AttentionParams | None) -> int:
    """How many keys the 64-key tiles one work item of ``rows`` query tokens reaches hold at most: its
    table's ``table_keys``, or fewer under a sliding window or a chunk, which bound the span from its first
    row's first visible key to its last row (``W - 1 + rows`` or ``C - 1 + rows`` keys), plus a tile's
    worth for where that span starts inside its first tile."""
    bounds = () if params is None else (params.sliding_window, params.chunk_size)
    return min([table_keys] + [b - 1 + rows + KEYS - 1 for b in bounds if b is not None])


def _item_splits(num_tokens: int, num_seqs: int, hkv: int, block_q: int, table_keys: int,
                 params: AttentionParams | None, sms: int | None) -> tuple[int, int]:
    """(busy items, ``default_splits``) of a call whose items hold ``block_q`` query tokens: each sequence
    wastes at most one partial item (``ragged.work_items``), and at most one item a token is busy. Its
    split counts only the tiles an item can reach (``item_keys``): a sliding window's layer splits its
    window, not its table, so it runs no empty programs and its combine reads fewer runs."""
    items = min(ragged.cdiv(num_tokens, block_q) + num_seqs, num_tokens)
    keys = item_keys(table_keys, min(block_q, num_tokens), params)
    return items, default_splits(items, hkv, keys, sms)


def default_warpgroups(num_tokens: int, num_seqs: int, num_q_heads: int, kv_pages_shape: tuple[int, ...], kv_dtype,
                       max_blocks: int, sms: int | None = None, params: AttentionParams | None = None) -> int:
    """Warpgroups per program (each 64 query rows of one item): 2 where the batch's sequences average
    enough query tokens to fill a 128-row item (``128 / G`` tokens: prefill chunks), two fit in shared
    memory, and their programs, one an SM at that size, context split as ``default_splits`` splits it,
    still fill ``FILL`` of the ``sms`` (``sm_count()``); else 1 (decode steps, where an item's second
    warpgroup would have no rows, and small prefills, which one-warpgroup programs spread wider; and
    always under ``HKV_MOSAIC_WARPGROUPS=1``)."""
    _, _, hkv, bs, d = kv_pages_shape
    block_q = 2 * ROWS // (num_q_heads // hkv)
    if (MAX_WARPGROUPS < 2 or num_tokens < num_seqs * block_q
            or smem_bytes(d, max_blocks, jnp.dtype(kv_dtype).itemsize, 2) > SMEM_BYTES):
        return 1
    sms = sm_count() if sms is None else sms
    items, splits = _item_splits(num_tokens, num_seqs, hkv, block_q, max_blocks * bs, params, sms)
    return 2 if items * hkv * splits >= FILL * sms else 1


def launch(num_tokens: int, num_seqs: int, num_q_heads: int, kv_pages_shape: tuple[int, ...], kv_dtype,
           max_blocks: int, *, warpgroups: int | None = None, splits: int | None = None,
           params: AttentionParams | None = None) -> tuple[int, int]:
    """``(warpgroups, splits)`` a call of these shapes (and attention ``params``: a window or chunk bounds
    the keys an item splits, ``item_keys``) runs with: each given, else its default on this GPU
    (``default_warpgroups``, then ``default_splits`` for the items of that size). Raises ``ValueError`` for
    ``warpgroups`` other than 1 or 2, two that do not fit in shared memory, or ``splits < 1``."""
    _, _, hkv, bs, d = kv_pages_shape
    if warpgroups is None:
        warpgroups = default_warpgroups(num_tokens, num_seqs, num_q_heads, kv_pages_shape, kv_dtype, max_blocks,
                                        params=params)
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups}")
    need = smem_bytes(d, max_blocks, jnp.dtype(kv_dtype).itemsize, warpgroups)
    if need > SMEM_BYTES:
        raise ValueError(f"two warpgroups of head_size {d} with {max_blocks} table columns do not fit in shared "
                         f"memory ({need} bytes)")
    if splits is None:
        block_q = warpgroups * ROWS // (num_q_heads // hkv)
        splits = _item_splits(num_tokens, num_seqs, hkv, block_q, max_blocks * bs, params, None)[1]
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    return warpgroups, splits


def sm_count() -> int:
    """Streaming multiprocessors of the GPU programs are built for: the abstract mesh's device while one is
    in use (``num_cores``), else the default device's ``core_count``; ``HOPPER_SMS`` where neither says
    (interpret mode on a CPU)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        cores = mesh.abstract_device.num_cores
    else:
        dev = jax.devices()[0]
        cores = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return int(cores) if cores else HOPPER_SMS


def default_splits(busy_items: int, num_kv_heads: int, max_keys: int, sms: int | None = None) -> int:
    """How many runs each item's keys are split into: enough that ``busy_items x num_kv_heads x splits``
    programs fill the ``sms`` streaming multiprocessors (``sm_count()``), at most one per 64-key tile of the
    longest table (``max_keys``) and ``MAX_SPLITS``; 1 where the items alone fill them (large batches,
    prefill)."""
    sms = sm_count() if sms is None else sms
    programs = max(1, busy_items * num_kv_heads)
    return max(1, min(sms // programs, ragged.cdiv(max_keys, KEYS), MAX_SPLITS))


def _item_metadata(items: ragged.WorkItems, query_start_loc, seq_lens, block_q,
                   params: AttentionParams, group: int, warpgroups: int):
    """Per item: scalars ``i32[I, META]`` and per warpgroup and row ``i32[I, warpgroups, 2, ROWS]``
    (position, first visible key)."""
    b = ragged.item_bounds(items, query_start_loc, seq_lens, block_q, params)
    key_hi = jnp.where(b.n_rows > 0, b.p0 + b.n_rows, b.k_lo)  # an empty item has no tiles
    scalars = jnp.stack([b.seq, b.k_lo, key_hi], axis=1).astype(jnp.int32)
    row = jnp.arange(warpgroups * ROWS) // group
    pos = b.p0[:, None] + row[None, :]
    ok = row[None, :] < b.n_rows[:, None]
    # First key each row sees: the mask of reference.key_mask as a lower bound.
    row_lo = ragged.first_visible_key(pos, params)
    rows = jnp.stack([jnp.where(ok, pos, -1), jnp.where(ok, row_lo, 0)], axis=1).astype(jnp.int32)
    return scalars, rows.reshape(-1, 2, warpgroups, ROWS).transpose(0, 2, 1, 3)


def _kernel(*refs, params: AttentionParams, scale: float, has_sinks: bool, chunk: int, splits: int,
            warpgroups: int):
    if has_sinks:
        meta_ref, rows_ref, bt_ref, q_ref, kv_ref, sinks_ref, *refs = refs
    else:
        (meta_ref, rows_ref, bt_ref, q_ref, kv_ref, *refs), sinks_ref = refs, None
    if splits > 1:
        o_ref, lse_ref, *refs = refs
    else:
        (o_ref, *refs), lse_ref = refs, None
    (meta_smem, rows_smem, bt_smem, q_smem, k_smem, v_smem, p_smem, row_smem, bars, own_bars, k_bars, v_bars,
     consumed, v_zeroed, *half) = refs
    fp8 = bool(half)  # fp8 pages: ``half`` holds each warpgroup's bf16 K and V tiles, which the wgmmas read
    item, h = jax.lax.axis_index("item"), jax.lax.axis_index("head")
    split = jax.lax.axis_index("split") if splits > 1 else 0
    wg = jax.lax.axis_index("wg") if warpgroups > 1 else 0
    mine = pl.ds(wg * ROWS, ROWS)  # this warpgroup's rows of the item

    def leader(f):  # warpgroup 0 alone copies what the warpgroups share
        return f() if warpgroups == 1 else pl.when(wg == 0)(f)

    bs, d = kv_ref.shape[3], k_smem.shape[2]
    copies = KEYS // chunk
    last_col = bt_smem.shape[0] * TABLE_COLS - 1
    q_tile, p_tile, rows_tile, row_tile = q_smem.at[wg], p_smem.at[wg], rows_smem.at[wg], row_smem.at[wg]
    leader(lambda: plgpu.copy_gmem_to_smem(meta_ref.at[item], meta_smem, bars.at[0]))
    plgpu.copy_gmem_to_smem(rows_ref.at[item, wg], rows_tile, own_bars.at[3 * wg])
    plgpu.copy_gmem_to_smem(q_ref.at[item, h, mine], q_tile, own_bars.at[3 * wg + 1])
    if has_sinks:
        plgpu.copy_gmem_to_smem(sinks_ref.at[h, mine], row_tile, own_bars.at[3 * wg + 2])
        plgpu.barrier_wait(own_bars.at[3 * wg + 2])
    plgpu.barrier_wait(bars.at[0])
    seq, key_lo, key_hi = meta_smem[_SEQ], meta_smem[_KEY_LO], meta_smem[_KEY_HI]
    tile_lo = key_lo // KEYS
    tile_hi = jnp.where(key_hi > key_lo, (key_hi + KEYS - 1) // KEYS, tile_lo)
    # This program's run of the item's tiles: the split-th of ``splits`` runs of equal length.
    per_run = (tile_hi - tile_lo + splits - 1) // splits
    run_lo = jnp.minimum(tile_lo + split * per_run, tile_hi)
    run_hi = jnp.minimum(run_lo + per_run, tile_hi)
    leader(lambda: plgpu.copy_gmem_to_smem(bt_ref.at[seq], bt_smem, bars.at[1]))
    plgpu.barrier_wait(own_bars.at[3 * wg])
    plgpu.barrier_wait(own_bars.at[3 * wg + 1])
    plgpu.barrier_wait(bars.at[1])

    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def to_compute(tile):  # an fp8 tile in registers, in q's dtype (through f32: ptxas converts fp8 to f16 only)
        return plgpu.load(tile, layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32).astype(q_smem.dtype)
    row_pos = plgpu.load(rows_tile.at[0], layout=row_layout)
    row_lo = plgpu.load(rows_tile.at[1], layout=row_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 1, layout=plgpu.Layout.WGMMA)

    def fetch(t, slot):
        # ``copies`` copies of ``chunk`` rows each (chunk divides the block size: none crosses a
        # page), one barrier each. Columns past the table (keys past the last position) are
        # clamped; their rows are masked.
        for c in range(copies):
            key = t * KEYS + c * chunk
            col_ = jnp.minimum(key // bs, last_col)
            page = bt_smem[col_ // TABLE_COLS, col_ % TABLE_COLS]
            src, dst = pl.ds(key % bs, chunk), pl.ds(c * chunk, chunk)
            plgpu.copy_gmem_to_smem(kv_ref.at[page, 0, h, src], k_smem.at[slot, dst], k_bars.at[slot * copies + c])
            plgpu.copy_gmem_to_smem(kv_ref.at[page, 1, h, src], v_smem.at[slot, dst], v_bars.at[slot * copies + c])

    def wait(bars_, slot):
        for c in range(copies):
            plgpu.barrier_wait(bars_.at[slot * copies + c])

    @pl.when(run_lo < run_hi)
    def _():
        leader(lambda: fetch(run_lo, 0))

    def body(t, carry):
        acc, m, l = carry
        slot = jax.lax.rem(t - run_lo, 2)

        @pl.when(t + 1 < run_hi)
        def _():
            def refill():
                if warpgroups > 1:  # the other slot held tile t - 1: both warpgroups must be done with it
                    pl.when(t > run_lo)(lambda: plgpu.barrier_wait(consumed.at[1 - slot]))
                fetch(t + 1, 1 - slot)
            leader(refill)

        wait(k_bars, slot)
        if fp8:
            k_tile = half[0].at[wg]
            k_tile[...] = to_compute(k_smem.at[slot])
            plgpu.commit_smem()
        else:
            k_tile = k_smem.at[slot]

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, k_tile.T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, KEYS), jnp.float32)) * scale
        if params.soft_cap is not None:
            s = params.soft_cap * jnp.tanh(s / params.soft_cap)
        k_pos = col + t * KEYS
        pos_b = jax.lax.broadcast_in_dim(row_pos, (ROWS, KEYS), [0])
        lo_b = jax.lax.broadcast_in_dim(row_lo, (ROWS, KEYS), [0])
        mask = (k_pos <= pos_b) & (k_pos >= lo_b)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

        wait(v_bars, slot)

        def visible(v):  # V rows outside [key_lo, key_hi) zeroed, so 0 * NaN never reaches O
            key = plgpu.broadcasted_iota(jnp.int32, (KEYS, d), 0, layout=plgpu.Layout.WGMMA) + t * KEYS
            return jnp.where((key >= key_lo) & (key < key_hi), v, jnp.zeros_like(v))

        if fp8:  # every tile goes through registers anyway: zero its stale rows there
            v_tile = half[1].at[wg]
            v_tile[...] = visible(to_compute(v_smem.at[slot]))
        else:
            v_tile = v_smem.at[slot]

            @pl.when((t == tile_lo) | (t == tile_hi - 1))
            def _():  # only the edge tiles can hold stale rows: warpgroup 0 zeroes them, another waits for it
                # (a barrier for each edge: nothing orders warpgroup 0's second arrival after the other's
                # first wait, and a barrier two phases ahead of a waiter never releases it)
                edge = v_zeroed.at[jnp.where(t == tile_lo, 0, 1)]

                def zero():
                    v_smem[slot] = visible(plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA))
                    if warpgroups > 1:
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(edge)
                leader(zero)
                if warpgroups > 1:
                    pl.when(wg != 0)(lambda: plgpu.barrier_wait(edge))

        # P goes through shared memory and into a fresh accumulator: the Mosaic GPU
        # interpreter takes wgmma operands from refs only (registers would save a trip).
        p_tile[...] = p.astype(p_tile.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_tile, v_tile)
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
        if warpgroups > 1:
            plgpu.barrier_arrive(consumed.at[slot])
        return acc, m_new, l

    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout),
    )
    acc, m, l = jax.lax.fori_loop(run_lo, run_hi, body, init)
    if splits > 1:  # each run's own output and log-denominator; the sink enters once, in split_combine
        l_ = jnp.where(l > 0, l, 1.0)
        row_tile[...] = jnp.where(l > 0, m + jnp.log(l_), MASK_VALUE)
        q_tile[...] = (acc / jax.lax.broadcast_in_dim(l_, acc.shape, [0])).astype(q_tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[item, h, split, mine])
        plgpu.copy_smem_to_gmem(row_tile, lse_ref.at[item, h, split, mine])
        plgpu.wait_smem_to_gmem(0)
        return
    if has_sinks:
        sink = plgpu.load(row_tile, layout=row_layout)
        m_fin = jnp.maximum(m, sink)
        corr = jnp.exp(m - m_fin)
        l = l * corr + jnp.exp(sink - m_fin)
        acc = acc * jax.lax.broadcast_in_dim(corr, acc.shape, [0])
    l = jnp.where(l > 0, l, 1.0)
    q_tile[...] = (acc / jax.lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, o_ref.at[item, h, mine])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("params", "interpret", "splits", "warpgroups", "out_rows"))
def paged_attention(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, params: AttentionParams,
                    sinks: jax.Array | None = None, *, interpret: bool | plgpu.InterpretGPUParams = False,
                    splits: int | None = None, warpgroups: int | None = None,
                    out_rows: int | None = None) -> jax.Array:
    """Ragged paged attention (shapes: ``reference.py``) with the Mosaic GPU kernel.

    ``splits``: runs each item's keys are split into (``None``: ``default_splits`` for these shapes on
    this GPU); ``warpgroups``: 1 or 2 per program, each with 64 query rows of an item (``None``:
    ``default_warpgroups`` on a GPU, 1 in interpret mode: the interpreter runs each warpgroup on a thread
    of the CPU client's pool, and on a machine of few cores two of them can wait on each other's barriers
    while neither thread runs; ``tests/mgpu_warpgroups.py`` runs two with more CPU devices, hence threads).
    ``interpret=True`` runs it in Mosaic GPU's interpreter on CPU (``plgpu.InterpretGPUParams(...)``: with
    those settings, e.g. ``detect_races=True``). Raises
    ``ValueError`` for shapes the kernel does not take (``supports``; with ``warpgroups=2``, also when two
    do not fit in shared memory), ``splits < 1`` or ``warpgroups`` other than 1 or 2.
    """
    num_tokens, hq, d = q.shape
    _, _, hkv, bs, _ = kv_pages.shape
    S, max_blocks = block_tables.shape
    support = supports(q.dtype, kv_pages.shape, kv_pages.dtype, hq, max_blocks)
    if not support:
        raise ValueError(f"Mosaic GPU paged attention does not take {support.reason}")
    group = hq // hkv
    warpgroups, splits = launch(num_tokens, query_start_loc.shape[0] - 1, hq, kv_pages.shape, kv_pages.dtype,
                                max_blocks, warpgroups=1 if interpret and warpgroups is None else warpgroups,
                                splits=splits, params=params)
    rows_per_item = warpgroups * ROWS
    block_q = rows_per_item // group
    items = ragged.work_items(query_start_loc, num_tokens, block_q, out_rows)
    n = items.seq.shape[0]
    scalars, rows = _item_metadata(items, query_start_loc.astype(jnp.int32),
                                   seq_lens.astype(jnp.int32), block_q, params, group, warpgroups)
    # [I, block_q, Hkv, G, D] -> [I, Hkv, rows, D]: one contiguous Q tile per warpgroup.
    q_items = ragged.gather_queries(q, items).reshape(n, block_q, hkv, group, d)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(n, hkv, rows_per_item, d)
    # Each table row as [rows, TABLE_COLS] (zero padded: the null block), one TMA copy.
    rows_ = _table_rows(max_blocks)
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, rows_ * TABLE_COLS - max_blocks)))
    bt = bt.reshape(S, rows_, TABLE_COLS)
    in_kernel_sinks = sinks is not None and splits == 1  # split runs: the sinks enter in split_combine
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    chunk = math.gcd(bs, KEYS)
    fp8 = is_fp8(kv_pages.dtype)
    # fp8 tiles are only read into registers: plain rows; the wgmma operands are tiled and swizzled.
    kv_tile = plgpu.SMEM((2, KEYS, d), kv_pages.dtype, **({} if fp8 else {"transforms": tiled}))
    half = [plgpu.SMEM((warpgroups, KEYS, d), q.dtype, transforms=tiled)] * 2 if fp8 else []
    threads = {"num_threads": warpgroups, "thread_name": "wg"} if warpgroups > 1 else {}
    kernel = plgpu.kernel(
        functools.partial(_kernel, params=params, scale=params.scale(d), has_sinks=in_kernel_sinks,
                          chunk=chunk, splits=splits, warpgroups=warpgroups),
        out_type=(jax.ShapeDtypeStruct((n, hkv, rows_per_item, d), q.dtype) if splits == 1 else
                  (jax.ShapeDtypeStruct((n, hkv, splits, rows_per_item, d), q.dtype),
                   jax.ShapeDtypeStruct((n, hkv, splits, rows_per_item), jnp.float32))),
        scratch_types=[
            plgpu.SMEM((8,), jnp.int32),
            plgpu.SMEM((warpgroups, 2, ROWS), jnp.int32),
            plgpu.SMEM((rows_, TABLE_COLS), jnp.int32),
            plgpu.SMEM((warpgroups, ROWS, d), q.dtype, transforms=tiled),
            kv_tile,
            kv_tile,
            plgpu.SMEM((warpgroups, ROWS, KEYS), q.dtype, transforms=tiled),
            plgpu.SMEM((warpgroups, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=2),  # the item's scalars, its table row
            plgpu.Barrier(num_barriers=3 * warpgroups),  # each warpgroup's rows, Q tile, sinks
            plgpu.Barrier(num_barriers=2 * (KEYS // chunk)),
            plgpu.Barrier(num_barriers=2 * (KEYS // chunk)),
            plgpu.Barrier(num_arrivals=warpgroups, num_barriers=2),  # a K/V slot read by every warpgroup
            plgpu.Barrier(num_barriers=2),  # the first and the last tile's stale V rows zeroed (by warpgroup 0)
            *half,
        ],
        grid=(n, hkv) if splits == 1 else (n, hkv, splits),
        grid_names=("item", "head") if splits == 1 else ("item", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None,
        **threads,
    )
    meta = jnp.pad(scalars, ((0, 0), (0, 8 - META)))  # 32-byte rows for TMA
    extra = ()
    if in_kernel_sinks:  # each row's head's sink
        extra = (jnp.repeat(sinks.astype(jnp.float32).reshape(hkv, 1, group), block_q, axis=1)
                 .reshape(hkv, rows_per_item),)
    o = kernel(meta, rows, bt, q_items, kv_pages, *extra)
    if splits > 1:
        return split_combine.combine(*o, sinks, items, group=group, interpret=bool(interpret))
    o = o.reshape(n, hkv, block_q, group, d).transpose(0, 2, 1, 3, 4).reshape(n, block_q, hq, d)
    return ragged.scatter_outputs(o, items)
