"""The host tier's in-step copies alone: GB/s of the page copies down (device -> host) and up (host -> device).

A KV pool of ``--model``'s pages (``--pool-blocks`` blocks of ``--block-size`` tokens, the model's cache
dtypes) and host pages of the same shapes in the device's host memory kind (``host_tier.host_memory_kind``:
``pinned_host`` on a GPU and on this CPU) are filled; then ``host_tier.copy_pages``, the function the step
program runs, copies ``K`` blocks (each of ``--blocks``) down and up in jitted programs that donate the
destination, as the engine's do. Per ``K`` and direction: the median of ``--repeats`` timed calls after a
warm-up, and GB/s of page bytes moved (every shared tensor's page of each block). On a CPU both sides are
RAM, so the figures time the gather, the scatter and the memory-space crossing; on a GPU they time PCIe or
NVLink-C2C transfers inside a program. ``--json`` prints one JSON row per line.

Run: ``python benchmarks/host_copy.py [--model gemma-3-270m] [--blocks 8,64,512] [--json]``; the suite runs
its smallest mode (``tests/test_benchmarks.py``).
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

from hkv_jax.allocator.host_tier import Copies, copy_pages, host_memory_kind
from hkv_jax.cache import init_cache
from hkv_jax.models import model_layers
from hkv_jax.planner import plan


def random_pages(buffers, num_blocks: int, memory_kind: str | None, seed: int):
    """Random pages shaped like ``buffers`` (``num_blocks`` blocks each) in ``memory_kind`` (``None``: the
    device's memory)."""
    rng = np.random.default_rng(seed)
    sharding = None if memory_kind is None else jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                                   memory_kind=memory_kind)
    return tuple(jax.device_put(rng.integers(0, 255, (num_blocks,) + b.shape[1:]).astype(b.dtype), sharding)
                 for b in buffers)


def timed(fn, src, dst, copies, repeats: int):
    """Median seconds of ``dst = fn(src, dst, copies)`` over ``repeats`` calls (after one warm-up), and the
    last ``dst``."""
    dst = jax.block_until_ready(fn(src, dst, copies))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst = jax.block_until_ready(fn(src, dst, copies))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), dst


def measure(args) -> None:
    """Time the copies of every ``--blocks`` count and print a row each."""
    kind = host_memory_kind()
    config = plan(model_layers(args.model), block_size=args.block_size, num_blocks=args.pool_blocks)
    device = random_pages(init_cache(config).buffers, args.pool_blocks, None, seed=0)
    host = random_pages(device, args.host_blocks, kind, seed=1)
    page_bytes = sum(b.shape[1] * b.dtype.itemsize for b in device)
    down = jax.jit(lambda s, d, c: copy_pages(s, d, c, kind, to_host=True), donate_argnums=1)
    up = jax.jit(lambda s, d, c: copy_pages(s, d, c, kind, to_host=False), donate_argnums=1)
    for k in args.blocks:
        if k >= min(args.pool_blocks, args.host_blocks):
            raise SystemExit(f"--blocks {k}: more than the pool ({args.pool_blocks}) or the tier "
                             f"({args.host_blocks}) holds, block 0 left out")
        blocks = jnp.arange(1, k + 1, dtype=jnp.int32)
        copies = Copies(blocks, blocks[::-1], jnp.int32(k))  # a permutation: every block moves
        row = {"bench": "host_copy", "model": args.model, "memory_kind": kind, "device": str(jax.devices()[0]),
               "blocks": k, "page_bytes": page_bytes}
        seconds_down, host = timed(down, device, host, copies, args.repeats)
        assert np.array_equal(np.asarray(host[0])[k], np.asarray(device[0])[1]), "copy down moved the wrong page"
        seconds_up, device = timed(up, host, device, copies, args.repeats)
        for label, seconds in (("down", seconds_down), ("up", seconds_up)):
            row[f"{label}_us"] = round(seconds * 1e6, 1)
            row[f"{label}_gb_per_s"] = float(f"{k * page_bytes / seconds / 1e9:.4g}")
        if args.json:  # a row a line as measured, so a run cut short keeps what it measured
            print(json.dumps(row), flush=True)
        else:
            print(f"{k:>5} blocks ({k * page_bytes / 2**20:.2f} MiB): down {row['down_us']:>9.1f} us "
                  f"{row['down_gb_per_s']:>7.2f} GB/s, up {row['up_us']:>9.1f} us {row['up_gb_per_s']:>7.2f} GB/s",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m", help="a preset whose page shapes are copied")
    ap.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 512],
                    help="blocks per copy (comma-separated; default 8,64,512)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=2048, help="device pool blocks (default 2048)")
    ap.add_argument("--host-blocks", type=int, default=4096, help="host tier blocks (default 4096)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if min(a.blocks) < 1 or a.repeats < 1:
        ap.error("--blocks and --repeats must be positive")
    if not a.json:
        from machine import describe
        print(describe(), file=sys.stderr)
    measure(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
