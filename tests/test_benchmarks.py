"""The benchmark scripts keep running: their ``--smoke`` modes on CPU (times are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmark_smoke_checks_and_times_every_implementation():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/attention_gpu.py"), "--smoke",
                           "--mode", "decode", "--json"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WRONG" not in proc.stderr and "cannot run" not in proc.stderr, proc.stderr[-2000:]
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    assert {r["impl"] for r in rows} == {"ours", "triton", "xla", "mosaic_gpu", "jax"}
    assert all(r["time_us"] > 0 and r["bytes"] > 0 for r in rows)


def test_window_eviction_benchmark_reaches_the_ideal_hits_in_an_ample_pool():
    # A pool that evicts nothing: both eviction orders serve every block computed before.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/window_eviction.py"), "--conversations", "3",
                           "--turns", "2", "--answer", "16", "--question", "8", "--window", "16",
                           "--block-size", "4", "--num-blocks", "200", "--seeds", "0", "--concurrency", "2",
                           "--system-prompt", "8", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["window_aware"] for r in rows] == [False, True]
    assert all(r["hit_tokens"] > 0 and r["hit_of_ideal"] == 1.0 for r in rows)


def test_allocator_benchmark_runs_both_decode_paths_and_reruns_with_hugepages():
    # 4 requests of one hybrid model: the vectorised prefill, idle steps (idle_decode) and busy ones.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/allocator_step.py"), "--models", "gptoss",
                           "--batch", "4", "--repeats", "1", "--malloc-hugepages", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)
    assert row["prefill_vectorised"] and row["malloc_hugepages"]
    assert sum(row["decode_paths"]) == 32 and row["decode_paths"][0] > 0 and row["decode_paths"][3] == 0
    assert row["decode_step_us"] > 0 and row["prefill_us_per_request"] > 0


def test_engine_benchmark_runs_against_the_allocator_benchmark():
    # 4 requests of one hybrid model through the engine (vectorised allocator; one decode step a call, then
    # two), with allocator_step.py's figures for the same workload alongside. The per-request path (--paths old) is the same Engine
    # with vectorised=False, which test_engine_paths.py runs step by step.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/engine_step.py"), "--models", "gptoss",
                           "--batch", "4", "--decode", "4", "--repeats", "1", "--paths", "new,multi",
                           "--decode-steps", "2", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    new, multi = json.loads(proc.stdout)["steps"]
    assert (new["path"], multi["path"]) == ("new", "multi")
    for row in (new, multi):
        assert row["decode_step_us"] > 0 and row["prefill_us_per_request"] > 0 and row["alloc_decode_us"] > 0
        assert row["floor_us"] > 0 and row["decode_host_us"] >= 0
    assert any(k.startswith("lean") for k in new["programs"])  # the decode fast path ran
    assert any(k.startswith("multi-step") for k in multi["programs"])  # several decode steps per program
