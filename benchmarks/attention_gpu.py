"""Paged attention on a GPU: decode and prefill time, achieved HBM bandwidth, fraction of peak.

Each case: B sequences of ``context`` tokens whose pages (``page`` tokens each) sit at random block
ids; 8 kv heads, head size 128, bf16 KV (``--kv-dtype fp8``: e4m3 pages, half the bytes, bf16 queries),
32 query heads. Decode: one query token per sequence.
Prefill: the last ``--prefill-chunk`` tokens of each sequence are queries (a chunked-prefill step).
Implementations: ``ours`` (``kernels_pallas.paged_attention``, ``impl=auto``: Mosaic GPU on Hopper), for
decode ``mosaic_gpu`` (that kernel, its context split as ``auto`` splits it; the rows say into how many runs)
and ``mosaic_gpu_nosplit`` (without the split), for prefill ``mosaic_gpu_1wg`` and ``mosaic_gpu_2wg`` (one or
two warpgroups a program, whichever ``auto`` picks; not ``--smoke``), ``triton`` (the portable Pallas kernel),
``xla`` (the jnp reference, compiled by XLA) and, for decode, ``jax``
(``jax.experimental.pallas.ops.gpu.paged_attention``, fed its own head-major page layout). Every
implementation is first checked against the reference on a small case. Bytes = K and V of every page a
sequence reads, plus q and out; bandwidth = bytes / median time; peak from the device's HBM spec. Prefill
rows also give TFLOP/s: 4 x head size x query heads per (query, visible key) pair, over the median time.
``--window W``: every layer a ``W``-token sliding window (Gemma 3's local layers), bytes those of the pages a
window covers; for decode ``mosaic_gpu_table_splits`` then splits the context as if the table bounded it (as
``auto`` did before a window bounded its runs), and JAX's kernel, which has no window, is left out.

``--smoke`` runs tiny cases on CPU (Pallas in interpret mode; times are meaningless there) so that CI
keeps the script working. Run: ``python benchmarks/attention_gpu.py [--batch 1,8,64,256]
[--context 1024,4096,32768] [--page 16,32,64] [--mode decode,prefill] [--kv-dtype fp8] [--window 512]
[--impls ours,mosaic_gpu] [--json]``;
``--json`` prints each row as a JSON line as soon as it is timed (a run cut short keeps the rows it has).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from kernels_pallas import paged_attention_mgpu, reference
from kernels_pallas.reference import AttentionParams

KV_HEADS, HEAD, Q_HEADS, DTYPE = 8, 128, 32, jnp.bfloat16
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}  # bytes/s (vendor spec)
XLA_LIMIT = 8 << 30  # the reference materialises gathered K/V (GQA-repeated): skip larger cases


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_HBM.items() if k in kind), None)


def make_case(batch: int, context: int, page: int, q_per_seq: int, seed: int = 0, kv_heads=KV_HEADS,
              head=HEAD, q_heads=Q_HEADS, kv_dtype=DTYPE):
    """Random q, pages in ``kv_dtype`` (random block ids, block 0 left as the null block) and metadata."""
    per_seq = -(-context // page)
    n = batch * per_seq + 1
    key = jax.random.key(seed)
    kq, kp = jax.random.split(key)
    pages = jax.random.normal(kp, (n, 2, kv_heads, page, head), DTYPE).astype(kv_dtype)
    tables = 1 + np.random.default_rng(seed).permutation(n - 1).reshape(batch, per_seq).astype(np.int32)
    q = jax.random.normal(kq, (batch * q_per_seq, q_heads, head), DTYPE)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * q_per_seq
    lens = jnp.full((batch,), context, jnp.int32)
    return q, pages, jnp.asarray(tables), qsl, lens


def case_bytes(batch: int, context: int, page: int, q_tokens: int, kv_heads=KV_HEADS, head=HEAD,
               q_heads=Q_HEADS, kv_dtype=DTYPE, window: int | None = None) -> int:
    """K and V of the pages each sequence reads (under a ``window``, those its last ``q_tokens / batch``
    queries' windows cover), plus q and out."""
    pages = -(-context // page)
    if window is not None:
        first = max(0, context - q_tokens // batch - window + 1)  # the first query's first visible key
        pages = (context - 1) // page - first // page + 1
    kv = batch * pages * page * 2 * kv_heads * head * jnp.dtype(kv_dtype).itemsize
    return kv + 2 * q_tokens * q_heads * head * jnp.dtype(DTYPE).itemsize


def implementations(mode: str, smoke: bool, kv_dtype=DTYPE, params: AttentionParams = AttentionParams()):
    """name -> fn(q, pages, tables, qsl, lens) for the implementations of ``mode`` under ``params``."""
    def paged(impl):
        return lambda *a: kernels_pallas.paged_attention(*a, params, impl=impl, interpret=smoke)
    # On CPU "auto" is the reference; --smoke times the portable kernel under "ours" instead.
    impls = {"ours": paged("triton" if smoke else "auto"), "triton": paged("triton"),
             "xla": lambda *a: reference.paged_attention(*a, params)}
    if smoke or kernels_pallas.default_impl() == "mosaic_gpu":
        def mosaic(**kw):
            return lambda *a: paged_attention_mgpu.paged_attention(*a, params, interpret=smoke, **kw)
        if mode == "decode":
            impls["mosaic_gpu"] = paged("mosaic_gpu")
            impls["mosaic_gpu_nosplit"] = mosaic(splits=1)
            if params.sliding_window is not None:
                impls["mosaic_gpu_table_splits"] = table_splits(smoke, params)
        else:  # "ours" runs the kernel as auto does; prefill cases fill the SMs without a split
            impls["mosaic_gpu_1wg"] = mosaic(warpgroups=1)
            if not smoke:  # interpreted, two warpgroups can starve each other on a small CPU (mgpu_warpgroups.py)
                impls["mosaic_gpu_2wg"] = mosaic(warpgroups=2)
    if mode == "decode" and jnp.dtype(kv_dtype) == jnp.dtype(DTYPE) and params == AttentionParams():
        # JAX's kernel reads q's dtype only, and has no window
        try:
            impls["jax"] = jax_paged_attention(smoke)
        except ImportError as e:  # JAX 0.12.1 dropped pallas.ops.gpu.paged_attention
            print(f"# JAX's own paged_attention left out: {e}", file=sys.stderr)
    return impls


def table_splits(smoke: bool, params: AttentionParams):
    """The Mosaic GPU kernel with its context split as the table alone would split it (``launch`` without
    ``params``): a window's layer then runs programs that find no key in their run."""
    def run(q, pages, tables, qsl, lens):
        _, splits = paged_attention_mgpu.launch(q.shape[0], qsl.shape[0] - 1, q.shape[1], pages.shape, pages.dtype,
                                                tables.shape[1], warpgroups=1 if smoke else None)
        return paged_attention_mgpu.paged_attention(q, pages, tables, qsl, lens, params, interpret=smoke,
                                                    splits=splits)
    return run


def jax_paged_attention(interpret: bool):
    """JAX's own Pallas paged_attention (decode only), given our inputs: its layout is made outside timing."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    def prepare(q, pages, tables, qsl, lens):
        k = jnp.moveaxis(pages[:, 0], 1, 0)  # [Hkv, N, page, D]
        v = jnp.moveaxis(pages[:, 1], 1, 0)
        q = (q * q.shape[-1] ** -0.5).astype(q.dtype)  # it applies no softmax scale itself
        return q, k, v, tables, lens

    def run(q, k, v, tables, lens):
        per_block, splits = jax_blocking(tables.shape[1], k.shape[2])
        return jpa.paged_attention(q, k, v, tables, lens, pages_per_compute_block=per_block,
                                   k_splits=splits, interpret=interpret)

    run.prepare = prepare
    return run


def jax_blocking(pages_per_seq: int, page: int) -> tuple[int, int]:
    """(pages per compute block, k splits) for JAX's kernel: 64-token blocks, up to 16 splits, dividing evenly."""
    per_block = max(1, 64 // page)
    while pages_per_seq % per_block:
        per_block //= 2
    blocks = pages_per_seq // per_block
    return per_block, max(d for d in range(1, 17) if blocks % d == 0)


def mosaic_form(batch: int, q_per_seq: int, context: int, page: int, kv_dtype=DTYPE,
                params: AttentionParams | None = None, **given) -> dict:
    """``{"warpgroups", "splits"}``: how the Mosaic GPU kernel runs a case (``paged_attention_mgpu.launch``:
    ``given`` ones, else its defaults under ``params``)."""
    wgs, splits = paged_attention_mgpu.launch(batch * q_per_seq, batch, Q_HEADS, (0, 2, KV_HEADS, page, HEAD),
                                              kv_dtype, -(-context // page), params=params, **given)
    return {"warpgroups": wgs, "splits": splits}


def prefill_flops(batch: int, context: int, q_per_seq: int) -> int:
    """Multiply-adds x 2 of QK^T and PV for the last ``q_per_seq`` tokens of each sequence (causal)."""
    pairs = q_per_seq * (context - q_per_seq) + q_per_seq * (q_per_seq + 1) // 2
    return 4 * batch * pairs * Q_HEADS * HEAD


def timed(fn, args, repeats: int) -> float:
    """Median wall time (us) of ``fn(*args)`` after one compiling call."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def check(impls, mode: str, kv_dtype=DTYPE, params: AttentionParams = AttentionParams()) -> dict[str, float]:
    """Max |impl - reference| on a small case per implementation (a failed check drops the impl)."""
    q_per = 1 if mode == "decode" else 8
    args = make_case(3, 128, 16, q_per, seed=1, kv_heads=2, q_heads=8, head=128, kv_dtype=kv_dtype)
    want = np.asarray(reference.paged_attention(*args, params), np.float32)
    errs = {}
    for name, fn in list(impls.items()):
        try:
            a = fn.prepare(*args) if hasattr(fn, "prepare") else args
            errs[name] = float(np.abs(np.asarray(jax.jit(fn)(*a), np.float32) - want).max())
        except Exception as e:  # report and go on with the others
            print(f"  {name}: cannot run ({type(e).__name__}: {str(e).splitlines()[0][:120]})", file=sys.stderr)
            del impls[name]
            continue
        if errs[name] > 0.05:
            print(f"  {name}: WRONG (max error {errs[name]:.3g}); not timed", file=sys.stderr)
            del impls[name]
    return errs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,8,32,64,128,256")
    p.add_argument("--context", default="1024,4096,16384,32768")
    p.add_argument("--page", default="16,32,64")
    p.add_argument("--mode", default="decode,prefill")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kv-dtype", choices=("bfloat16", "fp8"), default="bfloat16", help="the pages' dtype (fp8: e4m3)")
    p.add_argument("--window", type=int, default=None, help="a sliding window of this many tokens")
    p.add_argument("--impls", default=None, help="time only these implementations (comma-separated names)")
    p.add_argument("--smoke", action="store_true", help="tiny cases on CPU (interpret mode)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    kv_dtype = jnp.dtype(jnp.float8_e4m3fn if a.kv_dtype == "fp8" else DTYPE)
    params = AttentionParams(sliding_window=a.window)
    if a.smoke:
        a.batch, a.context, a.page, a.repeats, a.prefill_chunk = "2", "64", "16", 1, 4
    dev = jax.devices()[0]
    peak = peak_bandwidth()
    print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"peak HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s", file=sys.stderr)
    for mode in a.mode.split(","):
        impls = implementations(mode, a.smoke, kv_dtype, params)
        if a.impls is not None:
            wanted = a.impls.split(",")
            if unknown := [name for name in wanted if name not in impls]:
                p.error(f"--impls: no {', '.join(unknown)} for {mode} here; choose from {', '.join(impls)}")
            impls = {name: impls[name] for name in wanted}
        errs = check(impls, mode, kv_dtype, params)
        print(f"# {mode}: checked against the reference: "
              + ", ".join(f"{k} {v:.2g}" for k, v in errs.items() if k in impls), file=sys.stderr)
        q_per = 1 if mode == "decode" else a.prefill_chunk
        for page in map(int, a.page.split(",")):
            for context in map(int, a.context.split(",")):
                for batch in map(int, a.batch.split(",")):
                    args = make_case(batch, context, page, q_per, kv_dtype=kv_dtype)
                    nbytes = case_bytes(batch, context, page, batch * q_per, kv_dtype=kv_dtype, window=a.window)
                    for name, fn in impls.items():
                        if name == "xla" and nbytes * Q_HEADS // KV_HEADS * q_per > XLA_LIMIT:
                            continue
                        fa = fn.prepare(*args) if hasattr(fn, "prepare") else args
                        us = timed(fn, fa, a.repeats)
                        bw = nbytes / (us * 1e-6)
                        row = {"mode": mode, "impl": name, "batch": batch, "context": context, "page": page,
                               "time_us": round(us, 1), "bytes": nbytes, "bandwidth_gbs": round(bw / 1e9, 1),
                               "peak_fraction": round(bw / peak, 3) if peak else None,
                               "kv_dtype": kv_dtype.name, "device": dev.device_kind,
                               **({"window": a.window} if a.window else {})}
                        if name.startswith("mosaic_gpu") or (name == "ours" and not a.smoke
                                                              and kernels_pallas.default_impl() == "mosaic_gpu"):
                            wgs = 1 if a.smoke or name.endswith("1wg") else 2 if name.endswith("2wg") else None
                            row.update(mosaic_form(batch, q_per, context, page, kv_dtype,
                                                   None if name.endswith("table_splits") else params,
                                                   warpgroups=wgs, splits=1 if name.endswith("nosplit") else None))
                        if mode == "prefill":
                            row["tflops"] = round(prefill_flops(batch, context, q_per) / (us * 1e-6) / 1e12, 2)
                        if a.json:
                            print(json.dumps(row), flush=True)
                        print(f"{mode:8s} {name:18s} B={batch:<4d} ctx={context:<6d} page={page:<3d} "
                              f"{us:10.1f} us {bw / 1e9:9.1f} GB/s"
                              + (f" {100 * bw / peak:5.1f}% of peak" if peak else "")
                              + (f" {row['tflops']:7.1f} TFLOP/s" if "tflops" in row else "")
                              + (f" splits {row['splits']}, {row['warpgroups']} warpgroup(s)" if "splits" in row
                                 else ""), file=sys.stderr, flush=True)
                    del args
    return 0


if __name__ == "__main__":
    sys.exit(main())
