"""Paged-attention kernels against the dense oracle (interpret mode on CPU).

Every case is a small ragged batch built from unpaged sequences: each
sequence's K/V is cut into pages placed at random block ids, out-of-window
(or out-of-chunk) pages point at the null block, and a later sequence may
reuse an earlier one's first pages (a shared prefix). Pages no valid
position references, the null block included, hold NaN: they must never
reach an output.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_attention, first_visible
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas import blocked, reference
from kernels_pallas import paged_attention_mgpu as mgpu
from kernels_pallas import paged_attention_portable as portable
from kernels_pallas import paged_attention_tpu as tpu
from kernels_pallas.reference import AttentionParams

TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Case:
    q: np.ndarray           # [T, Hq, D]
    pages: np.ndarray       # [N, 2, Hkv, bs, D]
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    params: AttentionParams
    sinks: np.ndarray | None
    expected: np.ndarray    # dense oracle, f32 [T, Hq, D]
    dtype: str
    kv_dtype: str | None = None  # the pages' dtype, if not ``dtype``


@st.composite
def cases(draw, *, block_sizes=(8, 16, 32, 64), groups=(1, 2, 3, 4, 8), head_sizes=(64, 128, 256),
          dtypes=("float32", "bfloat16", "float16"), tail=np.nan, kv_dtype=None):
    """A random ragged batch; ``tail`` fills the unwritten slots of referenced pages. ``kv_dtype``: pages of
    that dtype (the oracle reads K/V rounded to it)."""
    bs = draw(st.sampled_from(block_sizes))
    g = draw(st.sampled_from(groups))
    hkv = draw(st.integers(1, 2))
    d = draw(st.sampled_from(head_sizes))
    dtype = draw(st.sampled_from(dtypes))
    window = draw(st.one_of(st.none(), st.integers(1, 3 * bs)))
    chunk = None if window else draw(st.one_of(st.none(), st.sampled_from([bs, 2 * bs, bs + bs // 2])))
    params = AttentionParams(sliding_window=window, chunk_size=chunk,
                             soft_cap=draw(st.sampled_from([None, 5.0])))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    n_seqs = draw(st.integers(1, 3))
    lens, q_lens = [], []
    for _ in range(n_seqs):
        length = draw(st.integers(1, 4 * bs))
        lens.append(length)
        q_lens.append(draw(st.sampled_from([1, draw(st.integers(1, length))])))  # decode or prefill
    max_blocks = -(-max(lens) // bs) + 1
    n_pages = n_seqs * max_blocks + 2
    free = list(rng.permutation(np.arange(1, n_pages)))
    pages = np.full((n_pages, 2, hkv, bs, d), np.nan, np.float32)
    tables = np.zeros((n_seqs + 1, max_blocks), np.int32)  # one unused sequence slot
    keys, vals = [], []
    for s, (length, q_len) in enumerate(zip(lens, q_lens)):
        kv = rng.normal(size=(2, length, hkv, d)).astype(np.float32)
        shared = 0
        if s and draw(st.booleans()):  # share the previous sequence's full first pages
            shared = min(lens[s - 1], length) // bs
            shared = int(np.argmin(np.append(tables[s - 1, :shared] != 0, False)))  # no null pages
            kv[:, :shared * bs] = keys[-1][:shared * bs], vals[-1][:shared * bs]
            tables[s, :shared] = tables[s - 1, :shared]
        lo = first_visible(length - q_len, params)
        for j in range(shared, -(-length // bs)):
            if (j + 1) * bs <= lo:
                continue  # out of every window / chunk: the null block
            page = free.pop()
            tables[s, j] = page
            pages[page] = tail
            n = min(bs, length - j * bs)
            pages[page, :, :, :n] = kv[:, j * bs:j * bs + n].transpose(0, 2, 1, 3)
        keys.append(kv[0])
        vals.append(kv[1])
    sinks = rng.normal(size=(g * hkv,)).astype(np.float32) if draw(st.booleans()) else None
    qsl = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    padding = draw(st.integers(0, 3))
    q = rng.normal(size=(sum(q_lens) + padding, g * hkv, d)).astype(np.float32)
    def cast(x, to=dtype):
        return np.asarray(jnp.asarray(x, to).astype(jnp.float32))
    expected = np.zeros(q.shape, np.float32)
    for s, (length, q_len) in enumerate(zip(lens, q_lens)):
        rows = slice(qsl[s], qsl[s + 1])
        k, v = (cast(x, kv_dtype or dtype) for x in (keys[s], vals[s]))
        expected[rows] = dense_attention(cast(q[rows]), k, v, params, sinks)
    return Case(q, pages, tables, qsl, np.array(lens + [0], np.int32), params, sinks, expected, dtype, kv_dtype)


def run(fn, case: Case, **kw) -> np.ndarray:
    dt = jnp.dtype(case.dtype)
    out = fn(jnp.asarray(case.q, dt), jnp.asarray(case.pages, case.kv_dtype or dt), jnp.asarray(case.block_tables),
             jnp.asarray(case.query_start_loc), jnp.asarray(case.seq_lens), case.params,
             None if case.sinks is None else jnp.asarray(case.sinks), **kw)
    assert out.shape == case.q.shape and out.dtype == dt
    return np.asarray(out.astype(jnp.float32))


def check(out: np.ndarray, case: Case) -> None:
    assert np.isfinite(out).all(), "stale (NaN) pages reached the output"
    np.testing.assert_allclose(out, case.expected, atol=TOL[case.dtype], rtol=TOL[case.dtype])


@settings(max_examples=15, **SETTINGS)
@given(cases())
def test_reference_equals_dense_attention(case):
    check(run(reference.paged_attention, case), case)


@settings(max_examples=10, **SETTINGS)
@given(cases())
def test_blocked_loop_equals_dense_attention(case):
    check(run(blocked.paged_attention, case), case)  # 1 query per work item where all can be decodes, else 16
    check(run(blocked.paged_attention, case, block_q=3, columns=3), case)  # tables padded to whole iterations


@settings(max_examples=12, **SETTINGS)
@given(cases(block_sizes=(8, 16, 24, 32, 64), groups=(1, 2, 3, 4, 5, 8)))
def test_portable_kernel_equals_dense_attention(case):
    # Block 24: read in 8-row tiles; groups 3 and 5: padded to 4 and 8 query heads.
    check(run(portable.paged_attention, case, block_q=4, interpret=True), case)


@settings(max_examples=4, **SETTINGS)
@given(cases(block_sizes=(16, 32, 48, 64), groups=(1, 2, 4, 8), head_sizes=(64, 128),
             dtypes=("bfloat16", "float16")))
def test_mosaic_gpu_kernel_equals_dense_attention(case):
    check(run(mgpu.paged_attention, case, interpret=True, splits=1, warpgroups=1), case)
    # Split over the context: 3 runs of each item's tiles (some empty where an item has fewer), combined.
    check(run(mgpu.paged_attention, case, interpret=True, splits=3, warpgroups=1), case)


def test_mosaic_gpu_kernel_with_two_warpgroups_equals_dense_attention():
    """Two warpgroups a program (128-row prefill items sharing each K/V tile), whole and split, over bf16,
    fp16 and fp8 pages: ``tests/mgpu_warpgroups.py``, in a process with four CPU devices (it says why)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "mgpu_warpgroups.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 cases equal the dense attention with two warpgroups" in proc.stdout, proc.stdout


@settings(max_examples=4, **SETTINGS)
@given(cases(block_sizes=(8, 16), groups=(1, 2, 4), head_sizes=(64, 128), dtypes=("float32",),
             kv_dtype="float8_e4m3fn"))
def test_fp8_pages_are_read_as_the_rounded_keys_and_values_by_every_kernel_that_takes_them(case):
    """fp8 (e4m3) pages under float32 queries: the reference, the blocked loop and the portable and TPU kernels
    (interpret mode) each equal the dense attention over the K/V rounded to fp8, to float32's tolerance.
    The Mosaic GPU kernel multiplies in bf16 over them (the next test): it refuses float32 queries, which
    the dispatcher casts."""
    for fn, kw in ((reference.paged_attention, {}), (blocked.paged_attention, {}),
                   (portable.paged_attention, {"block_q": 4, "interpret": True}),
                   (tpu.paged_attention, {"block_q": 4, "interpret": True})):
        check(run(fn, case, **kw), case)
    assert "bfloat16 needed" in mgpu.supports(case.q.dtype, case.pages.shape, case.kv_dtype, case.q.shape[1]).reason


@settings(max_examples=3, **SETTINGS)
@given(cases(block_sizes=(16, 32), groups=(1, 2, 4, 8), head_sizes=(64, 128), dtypes=("bfloat16",),
             kv_dtype="float8_e4m3fn"))
def test_mosaic_gpu_kernel_reads_fp8_pages_through_bf16_tiles(case):
    """fp8 pages under bf16 queries (interpret mode), whole and split over the context: the dense attention
    over the rounded K/V, to bf16's tolerance; NaN in the pages' unreferenced slots never reaches the output."""
    check(run(mgpu.paged_attention, case, interpret=True, splits=1), case)
    check(run(mgpu.paged_attention, case, interpret=True, splits=2), case)


def test_mosaic_gpu_splits_a_long_decode_and_its_window_over_runs():
    """One decode over 300 keys (5 tiles) in 2-5 runs, with a sink and a soft cap, and with a 100-key window
    (its runs split only the window's tiles; by default as many runs as the window can reach tiles); NaN in
    every page nothing references."""
    bs, hkv, g, d, length = 16, 2, 2, 64, 300
    rng = np.random.default_rng(1)
    kv = rng.normal(size=(2, length, hkv, d)).astype(np.float32)
    width = -(-length // bs) + 1
    pages = np.full((width + 2, 2, hkv, bs, d), np.nan, np.float32)
    tables = np.zeros((2, width), np.int32)
    for j in range(-(-length // bs)):
        tables[0, j] = j + 1
        n = min(bs, length - j * bs)
        pages[j + 1, :, :, :n] = kv[:, j * bs:j * bs + n].transpose(0, 2, 1, 3)
    q = rng.normal(size=(2, g * hkv, d)).astype(np.float32)  # the decode token and one padding row
    sinks = rng.normal(size=(g * hkv,)).astype(np.float32)
    as_bf16 = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q[:1], kv[0], kv[1])]
    window = AttentionParams(sliding_window=100)
    # By default an item splits the 3 tiles its 100-key window (and 2 query rows) can reach, not the table's 5.
    assert mgpu.launch(2, 2, g * hkv, pages.shape, jnp.bfloat16, width, params=window) == (1, 3)
    for params, with_sinks, splits in [(AttentionParams(soft_cap=5.0), True, 2), (window, False, 5),
                                       (window, False, None)]:
        sk = sinks if with_sinks else None
        expected = np.zeros(q.shape, np.float32)
        expected[:1] = dense_attention(*as_bf16, params, sk)
        case = Case(q, pages, tables, np.array([0, 1, 1], np.int32), np.array([length, 0], np.int32), params, sk,
                    expected, "bfloat16")
        check(run(mgpu.paged_attention, case, interpret=True, splits=splits), case)
        # The token's row alone, and the model's padding row added by the last pass (out_rows): split
        # (the combine writes it) and whole (the scatter to the tokens does).
        for runs in (splits, 1) if splits == 2 else ():
            out = mgpu.paged_attention(jnp.asarray(q[:1], jnp.bfloat16), jnp.asarray(pages, jnp.bfloat16),
                                       jnp.asarray(tables), jnp.asarray(case.query_start_loc),
                                       jnp.asarray(case.seq_lens), params, None if sk is None else jnp.asarray(sk),
                                       interpret=True, splits=runs, out_rows=2)
            check(np.asarray(out.astype(jnp.float32)), case)
    with pytest.raises(ValueError, match="splits must be at least 1"):
        run(mgpu.paged_attention, case, interpret=True, splits=0)


@settings(max_examples=6, **SETTINGS)
@given(cases(block_sizes=(8, 16, 24), groups=(1, 2, 3, 4), head_sizes=(64, 128)))
def test_tpu_kernel_equals_dense_attention(case):
    # TPU interpret mode also fills the VMEM double buffer with NaN before the first DMA lands.
    check(run(tpu.paged_attention, case, block_q=4, interpret=True), case)


def test_mosaic_gpu_reads_a_table_row_longer_than_one_copy_moves():
    """A table wider than ``TABLE_COLS`` sits in shared memory as several rows (one TMA copy moves at most 256
    entries a dimension): a decode at position 1,124 with a 40-token window reads columns 67 to 70, in the
    second row."""
    bs, hkv, g, d, length, window = 16, 1, 2, 64, 1125, 40
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(2, length, hkv, d)).astype(np.float32)
    width = -(-length // bs) + 1                                       # 72 columns: two rows of 64
    pages = np.full((6, 2, hkv, bs, d), np.nan, np.float32)
    tables = np.zeros((1, width), np.int32)
    for page, j in enumerate(range((length - window) // bs, -(-length // bs)), start=1):
        tables[0, j] = page
        n = min(bs, length - j * bs)
        pages[page, :, :, :n] = kv[:, j * bs:j * bs + n].transpose(0, 2, 1, 3)
    params = AttentionParams(sliding_window=window)
    q = rng.normal(size=(1, g * hkv, d)).astype(np.float32)
    as_bf16 = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, kv[0], kv[1])]
    case = Case(q, pages, tables, np.array([0, 1], np.int32), np.array([length], np.int32), params, None,
                dense_attention(*as_bf16, params, None), "bfloat16")
    assert width > mgpu.TABLE_COLS and mgpu.supports(jnp.bfloat16, pages.shape, jnp.bfloat16, g * hkv, width)
    check(run(mgpu.paged_attention, case, interpret=True), case)
    assert "16,384" in mgpu.supports(jnp.bfloat16, pages.shape, jnp.bfloat16, g, 16_385).reason


def test_mosaic_gpu_refuses_shapes_it_cannot_take():
    q = jnp.zeros((4, 8, 64), jnp.float32)
    pages = jnp.zeros((3, 2, 2, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="bf16, fp16 or fp8 only"):
        mgpu.paged_attention(q, pages, jnp.zeros((1, 2), jnp.int32), jnp.array([0, 4]),
                             jnp.array([4]), AttentionParams())
    assert not mgpu.supports(jnp.bfloat16, (3, 2, 2, 8, 64), jnp.bfloat16, 8)  # page 8


@settings(max_examples=10, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 16, 64]),
       st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]))
def test_kv_write_kernel_equals_reference(seed, bs, dtype):
    """The portable kernel (through the dispatcher) writes what the jnp scatter writes, its values read in place
    from heads 3-4 of a wider array with a row more (a fused QKV product's output, padded); K/V past fp8's
    range (here up to some 1,500) are stored saturated, never as NaN."""
    import kernels_pallas

    rng = np.random.default_rng(seed)
    n, hkv, d, t = 5, 2, 64, 7
    pages = jnp.asarray(rng.normal(size=(n, 2, hkv, bs, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(t, hkv, d)) * 300, jnp.float32) for _ in range(2))
    slots = rng.choice(np.arange(bs, n * bs), size=t, replace=False)  # never the null block
    slots[rng.random(t) < 0.3] = -1
    expected = reference.kv_write(pages, k, v, jnp.asarray(slots))
    heads = jnp.asarray(rng.normal(size=(t + 1, 3 + hkv + 1, d)), jnp.float32).at[:t, 3:3 + hkv].set(v)
    out = kernels_pallas.kv_write(pages, k, heads, jnp.asarray(slots), v_head=3, impl="triton_interpret")
    assert (kernels_pallas.kv_write(pages, k, heads, jnp.asarray(slots), v_head=3, impl="reference") == expected).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    if dtype == "float8_e4m3fn" and (slots >= 0).any():  # some of a slot's 2 * 2 * 64 values pass 448
        assert np.abs(np.asarray(out, np.float32)).max() == 448
    # Only the written slots changed, and they hold the new K/V.
    changed = np.asarray(out != pages).any(axis=(1, 2, 4))           # [n, bs]
    written = np.zeros((n, bs), bool)
    for s in slots[slots >= 0]:
        written[s // bs, s % bs] = True
        np.testing.assert_array_equal(np.asarray(out[s // bs, 0, :, s % bs], np.float32),
                                      np.asarray(reference.to_page_dtype(k[list(slots).index(s)], dtype), np.float32))
    assert not (changed & ~written).any()


@settings(max_examples=8, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["float32", "bfloat16"]),
       st.booleans(), st.booleans(), st.sampled_from([0.0, 1.0]))
def test_kv_write_finishes_raw_keys_as_the_model_layers_do(seed, page_dtype, raw_dtype, norm, rotate, offset):
    """Raw keys read in place (heads 1-2 of a wider array with a row more) and finished in the portable
    kernel's store (interpret mode) are what the models' own layers make of them, RMSNorm over the whole
    vector then ``layers.rope``, written by the jnp scatter: within float32 rounding, which (the norm sums
    the halves apart) may move a bfloat16 value by one step, rarely."""
    import kernels_pallas
    from hkv_jax.models.layers import rope
    from kernels_pallas.key_finish import KeyFinish, rope_frequencies

    rng = np.random.default_rng(seed)
    n, hkv, d, t, bs, theta = 4, 2, 32, 5, 8, 10_000.0
    pages = jnp.asarray(rng.normal(size=(n, 2, hkv, bs, d)), page_dtype)
    heads = jnp.asarray(rng.normal(size=(t + 1, 5, d)) * 4, raw_dtype)
    positions = jnp.asarray(rng.integers(0, 40_000, t + 1), jnp.int32)
    weight = jnp.asarray(rng.normal(size=d) * 0.5, jnp.float32)
    slots = rng.choice(np.arange(bs, n * bs), size=t, replace=False)
    slots[rng.random(t) < 0.3] = -1
    finish = KeyFinish(positions, weight if norm else None, rope_frequencies(d, theta) if rotate else None,
                       norm_offset=offset, eps=1e-6)

    k = heads[:t, 1:3]
    if norm:
        k32 = k.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(k32 * k32, axis=-1, keepdims=True) + 1e-6)
        k = (k32 * scale * (offset + weight)).astype(k.dtype)
    k = rope(k, positions[:t], theta) if rotate else k
    expected = reference.kv_write(pages, k, heads[:t, 3:5], jnp.asarray(slots))
    for impl in ("triton_interpret", "reference"):
        out = kernels_pallas.kv_write(pages, heads, heads, jnp.asarray(slots), k_head=1, v_head=3, k_finish=finish,
                                      impl=impl)
        out, want = np.asarray(out, np.float32), np.asarray(expected, np.float32)
        exact = page_dtype == "float32"
        np.testing.assert_allclose(out, want, rtol=2e-6 if exact else 2**-7, atol=2e-6 if exact else 0)
        assert exact or (out == want).mean() > 0.99


def test_dispatch_picks_by_platform_and_refuses_unknown_impls():
    import kernels_pallas

    assert kernels_pallas.default_impl() == "blocked"  # this suite runs on CPU
    q = jnp.ones((2, 2, 64), jnp.float32)
    pages = jnp.ones((3, 2, 1, 8, 64), jnp.float32)
    args = (q, pages, jnp.array([[1], [2]]), jnp.array([0, 1, 2]), jnp.array([1, 1]), AttentionParams())
    np.testing.assert_allclose(np.asarray(kernels_pallas.paged_attention(*args)), 1.0)
    for impl in ("blocked", "reference", "triton_interpret"):  # a model's padding rows after the tokens'
        out = np.asarray(kernels_pallas.paged_attention(*args, impl=impl, out_rows=4))
        assert out.shape == (4, 2, 64) and (out[:2] == 1.0).all() and (out[2:] == 0).all()
    with pytest.raises(ValueError, match="unknown impl"):
        kernels_pallas.paged_attention(*args, impl="cuda")


@pytest.mark.parametrize("window, chunk, soft_cap, with_sinks", [(40, None, None, True), (None, 100, 5.0, False),
                                                                  (None, None, None, False)])
def test_the_models_dense_attention_in_query_blocks_equals_the_oracle(monkeypatch, window, chunk, soft_cap,
                                                                       with_sinks):
    """The models' uncached attention (``hkv_jax.models.layers.dense_attention``, which prompt log-probabilities
    run on) over a sequence of several query blocks (4 blocks of 64 rows here) against the numpy oracle."""
    from hkv_jax.models import layers

    monkeypatch.setattr(layers, "DENSE_QUERY_BLOCK", 64)
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(256, h, 32)).astype(np.float32) for h in (4, 2, 2))
    sinks = rng.normal(size=4).astype(np.float32) if with_sinks else None
    got = layers.dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window, chunk=chunk,
                                 soft_cap=soft_cap, sinks=None if sinks is None else jnp.asarray(sinks))
    params = AttentionParams(sliding_window=window, chunk_size=chunk, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), dense_attention(q, k, v, params, sinks), atol=2e-5, rtol=0)
