"""Float32 against int8 matrix products at Gemma 3 270M's shapes, as XLA compiles them for this machine.

Per shape ``[R, K] x [K, N]`` and row count R: the median of ``--repeats`` timed calls (after one
warm-up call) of
- ``float32``: ``x @ w``;
- ``int8``: ``hkv_jax.models.quant.int8_matmul`` on int8 weights stored ``[N, K]``, as ``Int8Linear``
  stores them (activations rounded per row; one row padded to two);
- ``int8 unpadded``: the bare one-row int8 product, without that padding, to show why it pads.

Shapes: the output projection ``[R, 640] x [640, 262144]`` and an MLP input ``[R, 640] x [640, 2048]``.
Run: ``python benchmarks/matmul_cpu.py [--rows 1,2,8,32,128] [--repeats 7] [--shapes "mlp up"] [--json]``; the
suite runs ``--shapes "mlp up" --rows 1,2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np

from hkv_jax.models.quant import int8_matmul

SHAPES = {"output projection": (640, 262144), "mlp up": (640, 2048)}


def median_ms(f, *args, repeats: int) -> float:
    """Median wall time of ``f(*args)`` in ms over ``repeats`` calls, after one untimed call."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return round(sorted(times)[len(times) // 2] * 1e3, 2)


def int8_product(xq, weight):
    """The bare int8 x int8 -> int32 product (``weight: [out, in]``), with no padding (nor rounding) around it."""
    return jax.lax.dot_general(xq, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def main(argv=None) -> int:
    """Time and print (``--json``: one JSON object)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,8,32,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES) or args.repeats < 1:
        ap.error(f"--shapes takes {', '.join(SHAPES)}; --repeats must be positive")
    rng = np.random.default_rng(0)
    rows = []
    for name, (k, n) in ((name, SHAPES[name]) for name in shapes):
        w = jnp.asarray(rng.standard_normal((k, n), np.float32))
        q = jnp.asarray(rng.integers(-127, 128, (n, k)).astype(np.int8))  # [out, in], as Int8Linear stores it
        scale = jnp.ones((n,), jnp.float32)
        for r in (int(v) for v in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((r, k), np.float32))
            row = {"shape": name, "k": k, "n": n, "rows": r,
                   "float32_ms": median_ms(jax.jit(jnp.matmul), x, w, repeats=args.repeats),
                   "int8_ms": median_ms(jax.jit(int8_matmul), x, q, scale, repeats=args.repeats)}
            if r == 1:
                row["int8_unpadded_ms"] = median_ms(jax.jit(int8_product), x.astype(jnp.int8), q,
                                                    repeats=args.repeats)
            rows.append(row)
            if not args.json:
                extra = f", int8 unpadded {row['int8_unpadded_ms']}" if r == 1 else ""
                print(f"{name} [{r}, {k}] x [{k}, {n}]: float32 {row['float32_ms']} ms, int8 {row['int8_ms']} ms"
                      f"{extra}", flush=True)
    machine.print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
