"""Audit a lowered serving program for what would waste a GPU's or TPU's memory bandwidth: a KV pool buffer
that is not donated and aliased to an output (the program would copy the pool every step), and ops that
copy, convert or re-lay-out a whole pool tensor (a ``while_loop`` carry copy, a transpose, a dtype change).

It reads the StableHLO text of a lowering (``jax.jit(f).trace(...).lower(lowering_platforms=(...))``), so it
runs on a machine without the accelerator: ``benchmarks/gpu_projection.py`` audits the engine's decode
programs for an abstract H200 and TPU v5p, and ``tests/test_lowering.py`` a tiny model's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KERNELS = re.compile(r"custom_call @(__gpu\$xla\.gpu\.triton|mosaic_gpu\w*|tpu_custom_call)")
# Ops that move no data of their own: calls and control flow pass buffers along, a reshape is a view.
PLUMBING = {"func.call", "call", "func.return", "return", "stablehlo.return", "stablehlo.while", "stablehlo.case",
            "stablehlo.if", "stablehlo.optimization_barrier", "stablehlo.reshape", "sdy.sharding_constraint",
            "stablehlo.tuple", "stablehlo.get_tuple_element", "func.func"}
# Writes into the donated pool, in place (the KV write and a Mamba state's write), and reads of a part of it
# (a Mamba state's pages, gathered): neither moves a pool's worth of data.
IN_PLACE = {"stablehlo.scatter", "stablehlo.dynamic_update_slice"}
SLICES = {"stablehlo.gather", "stablehlo.dynamic_slice", "stablehlo.slice"}
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")
_BITS = {"bf16": 16, "f16": 16, "f32": 32, "f64": 64, "i1": 8, "i8": 8, "ui8": 8, "i16": 16, "i32": 32,
         "ui32": 32, "i64": 64, "ui64": 64, "f8E4M3FN": 8, "f8E5M2": 8}


def tensor_bytes(dims: str, dtype: str) -> int:
    """Bytes of a StableHLO ``tensor<{dims}x{dtype}>``."""
    return math.prod(int(d) for d in dims.split("x") if d) * _BITS.get(dtype, 32) // 8


@dataclass
class PoolAudit:
    """What ``audit_pool`` found in one lowered module."""

    aliased_pool: bool
    pool_copies: int
    pool_ops: list[str]


def audit_pool(text: str, num_blocks: int, pool_bytes: int, num_pool: int) -> PoolAudit:
    """Audit StableHLO ``text``: are the ``num_pool`` KV pool arguments (``[num_blocks, ...]``, ``pool_bytes``
    each) all aliased to outputs, and which ops other than the kernels, in-place writes (``IN_PLACE``), reads
    of a part (``SLICES``: their result only) and plumbing touch a pool-sized tensor (one with ``num_blocks``
    rows and half a pool's bytes or more: a copy, a layout change or a conversion of the pool)."""

    def pool_sized(dims: str, dtype: str) -> bool:
        first = dims.split("x")[0]
        return bool(first) and int(first) % num_blocks == 0 and tensor_bytes(dims, dtype) * 2 >= pool_bytes

    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    args = re.findall(r"%arg\d+: (tensor<[^>]*>)( \{[^}]*\})?", main)
    pool_args = [attrs for ty, attrs in args if pool_sized(*_TENSOR.match(ty).groups())]
    aliased = len(pool_args) == num_pool and all("tf.aliasing_output" in a for a in pool_args)
    ops = []
    for line in text.splitlines():
        m = re.search(r"=\s*\"?([a-z_]+\.[a-z_]+|call)\b", line)
        if not m or m.group(1) in PLUMBING or m.group(1) in IN_PLACE or KERNELS.search(line):
            continue
        types = _TENSOR.findall(line)
        if m.group(1) in SLICES:  # reads its slice of the pool: only its result counts
            types = types[-1:]
        if any(pool_sized(d, t) for d, t in types):
            ops.append(m.group(1))
    return PoolAudit(aliased, len(ops), sorted(set(ops)))
