"""The Mosaic GPU kernel with two warpgroups a program against the dense oracle, in Mosaic GPU's interpreter
with its race detector on:
``test_kernels.py::test_mosaic_gpu_kernel_with_two_warpgroups_equals_dense_attention`` runs this file in a
process of its own with four CPU devices (``JAX_NUM_CPU_DEVICES=4``). The interpreter runs each warpgroup on a
thread of the CPU client's pool, which has as many threads as the machine has cores or the client devices;
with two (a 2-core machine, one device) a warpgroup waiting at a barrier can hold the thread the other one
needs to arrive there. Exits non-zero on the first case that differs; prints how many passed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from test_kernels import cases, check, run  # noqa: E402

from kernels_pallas import paged_attention_mgpu as mgpu  # noqa: E402

# The interpreter's race detector raises where two warpgroups touch the same shared memory unordered by a
# barrier (a K/V slot refilled before both are done with it, an edge tile zeroed while the other reads it).
RACES = plgpu.InterpretGPUParams(detect_races=True)

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.data_too_large])
passed = []


@settings(max_examples=2, **SETTINGS)
@given(cases(block_sizes=(16, 48, 64), groups=(1, 2, 4, 8), head_sizes=(64, 128), dtypes=("bfloat16", "float16")))
def half_pages(case):
    """bf16/fp16 pages: 128-row items whole and split over the context (sinks, soft cap, windows, chunks,
    padding tokens and stale NaN pages as the in-process tests draw them)."""
    check(run(mgpu.paged_attention, case, interpret=RACES, splits=1, warpgroups=2), case)
    check(run(mgpu.paged_attention, case, interpret=RACES, splits=2, warpgroups=2), case)
    passed.append(case)


@settings(max_examples=1, **SETTINGS)
@given(cases(block_sizes=(16, 32), groups=(2, 4), head_sizes=(64,), dtypes=("bfloat16",),
             kv_dtype="float8_e4m3fn"))
def fp8_pages(case):
    """fp8 pages: each warpgroup converts the shared tile into its own bf16 copy."""
    check(run(mgpu.paged_attention, case, interpret=RACES, splits=1, warpgroups=2), case)
    passed.append(case)


if __name__ == "__main__":
    half_pages()
    fp8_pages()
    print(f"{len(passed)} cases equal the dense attention with two warpgroups")
