"""The ``blocked`` paged attention (the CPU default) with 1 to 8 block-table columns per loop iteration.

Per case and ``columns`` value: the median of ``--repeats`` timed calls (after one warm-up call) of
``kernels_pallas.blocked.paged_attention`` at XLA's full optimization, and the largest difference of its
output from the one-column loop's (the kernel tests check both against dense attention). ``auto`` is the
kernel's default (``blocked.COLUMNS``, spread evenly over the table). Pages sit at consecutive block ids,
float32; the null block holds NaN, which masking must keep out of the output.

Cases (``T`` query tokens of ``S`` sequences of ``L`` tokens, block size 16): Gemma 3 270M's attention
(4 query heads, 1 KV head of 256) at 880 tokens (decode, a 64-token prefill, the same under its 512-token
window) and at 192 tokens (decode, a 512-token prefill), a 256-sequence decode over 2,048 tokens (32
query heads, 8 KV heads of 128), and 32 sequences over 1,000 tokens (8 query heads, 2 KV heads of 64).
Run: ``python benchmarks/attention_cpu.py [--columns 1,4,8,auto] [--repeats 20] [--smoke] [--json]``.
"""

from __future__ import annotations

import argparse
import os
import sys

# XLA's full optimization: what a user's program gets (the test suite turns most of it off).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")

import jax.numpy as jnp  # noqa: E402
import machine  # noqa: E402
import numpy as np  # noqa: E402
from matmul_cpu import median_ms  # noqa: E402

from kernels_pallas import blocked  # noqa: E402
from kernels_pallas.reference import AttentionParams  # noqa: E402

# name: (T, S, query heads, KV heads, head size, L, sliding window)
CASES = {
    "gemma3 decode 880": (8, 8, 4, 1, 256, 860, None),
    "gemma3 prefill 64 of 880": (64, 4, 4, 1, 256, 860, None),
    "gemma3 prefill 64 of 880, window 512": (64, 4, 4, 1, 256, 860, 512),
    "gemma3 decode 192": (8, 8, 4, 1, 256, 192, None),
    "gemma3 prefill 512 of 192": (512, 4, 4, 1, 256, 192, None),
    "256 sequences decode 2048": (256, 256, 32, 8, 128, 2048, None),
    "32 sequences decode 1000": (32, 32, 8, 2, 64, 1000, None),
}
SMOKE = {"smoke decode": (4, 4, 4, 2, 16, 70, None), "smoke prefill, window 24": (24, 2, 4, 2, 16, 40, 24)}
BLOCK = 16


def make_case(T: int, S: int, hq: int, hkv: int, d: int, L: int, window, seed: int = 0):
    """The kernel's arguments: random pages (block ids ``1..``, the null block NaN), ``T / S`` queries per
    sequence at its last positions."""
    rng = np.random.default_rng(seed)
    M = -(-L // BLOCK) + 1  # one column past the last page, as an engine's table has room to grow
    pages = rng.standard_normal((S * M + 1, 2, hkv, BLOCK, d)).astype(np.float32)
    pages[0] = np.nan
    tables = np.zeros((S, M), np.int32)
    tables[:, :M - 1] = 1 + np.arange(S * (M - 1)).reshape(S, M - 1)
    qsl = np.arange(S + 1, dtype=np.int32) * (T // S)
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(pages), jnp.asarray(tables), jnp.asarray(qsl), jnp.full(S, L, jnp.int32),
            AttentionParams(sliding_window=window))


def main(argv=None) -> int:
    """Time and print (``--json``: one JSON object)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--columns", default="1,4,8,auto", help="columns per iteration: numbers and 'auto'")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="two tiny cases (CI keeps the script working)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        columns = [None if c == "auto" else int(c) for c in args.columns.split(",")]
        if any(c is not None and c < 1 for c in columns) or args.repeats < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--columns takes positive numbers and 'auto' (got {args.columns!r}); --repeats >= 1")
    rows = []
    for name, shape in (SMOKE if args.smoke else CASES).items():
        q, pages, tables, qsl, lens, params = make_case(*shape)
        one = np.asarray(blocked.paged_attention(q, pages, tables, qsl, lens, params, columns=1))
        if not np.isfinite(one).all():
            raise SystemExit(f"{name}: the null block's NaN reached the output")
        for c in columns:
            run = lambda: blocked.paged_attention(q, pages, tables, qsl, lens, params, columns=c)  # noqa: E731
            out = np.asarray(run())
            row = {"case": name, "columns": c or "auto", "ms": median_ms(run, repeats=args.repeats),
                   "max_diff_from_1": float(np.abs(out - one).max())}
            rows.append(row)
            if not args.json:
                print(f"{name}: columns {row['columns']}: {row['ms']} ms (differs from 1 column by "
                      f"{row['max_diff_from_1']:.1e})", flush=True)
    machine.print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
