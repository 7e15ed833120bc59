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
    assert {r["impl"] for r in rows} == {"ours", "triton", "xla", "mosaic_gpu", "mosaic_gpu_nosplit", "jax"}
    assert all(r["splits"] >= 1 for r in rows if r["impl"] == "mosaic_gpu")
    assert all(r["time_us"] > 0 and r["bytes"] > 0 for r in rows)


def test_cpu_attention_benchmark_times_each_column_count_with_equal_outputs():
    script = str(ROOT / "benchmarks/attention_cpu.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--columns", "1,3,auto", "--repeats", "2", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["case"], r["columns"]) for r in rows] == [
        (case, c) for case in ("smoke decode", "smoke prefill, window 24") for c in (1, 3, "auto")]
    assert all(r["ms"] > 0 and r["max_diff_from_1"] < 1e-5 for r in rows)
    bad = subprocess.run([sys.executable, script, "--columns", "0"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert bad.returncode == 2 and "--columns takes positive numbers" in bad.stderr


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


def test_policy_benchmark_hits_on_16_tokens_under_min_waste_and_32_under_vllm():
    # A pool that evicts nothing: min-waste (one block size, 16) serves every 16-token block computed before;
    # vllm (full-attention blocks of 32) only up to the last 32-token boundary, so less.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/policy_hits.py"), "--conversations", "2",
                           "--turns", "2", "--answer", "24", "--question", "24", "--window", "32",
                           "--num-blocks", "600", "--seeds", "0", "--concurrency", "2", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    vllm, ours = json.loads(proc.stdout)
    assert (vllm["policy"], vllm["hit_unit"], ours["policy"], ours["hit_unit"]) == ("vllm", 32, "min-waste", 16)
    assert ours["num_blocks"] == 2 * vllm["num_blocks"]  # the same bytes in half-size blocks
    assert ours["hit_of_ideal"] == 1.0 and 0 < vllm["hit_tokens"] < ours["hit_tokens"]


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
    # up to two), with allocator_step.py's figures for the same workload alongside. The per-request path
    # (--paths old) is the same Engine with vectorised=False, which test_engine_paths.py runs step by step.
    # Window-aware eviction: the first decode step takes new blocks while out-of-window ones go to the front
    # of the queue. One K of --decode-steps: each more compiles another multi-step program (13 s of CPU).
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/engine_step.py"), "--models", "gptoss",
                           "--batch", "4", "--decode", "4", "--repeats", "1", "--paths", "new,multi",
                           "--decode-steps", "2", "--window-aware-eviction", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    new, multi = json.loads(proc.stdout)["steps"]
    assert [(r["path"], r["decode_steps"]) for r in (new, multi)] == [("new", 1), ("multi", 2)]
    for row in (new, multi):
        assert row["decode_step_us"] > 0 and row["decode_step_mean_us"] > 0 and row["prefill_us_per_request"] > 0
        assert row["alloc_decode_us"] > 0 and row["floor_us"] > 0 and row["decode_host_us"] >= 0
        assert row["window_aware_eviction"] is True
    assert any(k.startswith("lean") for k in new["programs"])  # the decode fast path ran
    assert any(k.startswith("multi-step") for k in multi["programs"])  # several decode steps per program


def test_vllm_mean_script_reports_the_mean_of_the_steps_the_oracle_takes_the_median_of(tmp_path):
    # A stand-in for the oracle's replay.py (vLLM is not a dependency): bench_one takes the median of its
    # step times first, as the oracle's does; the script must report that median, the mean and the first step.
    (tmp_path / "replay.py").write_text(
        "import statistics, types\n"
        "vllm = types.SimpleNamespace(__version__='stand-in')\n"
        "BENCH_MODELS = {}\n"
        "def bench_one(model, B, L, D, bs, caching, shared_prefix, seed):\n"
        "    steps = [0.009 + seed * 0.001] + [0.001] * (D - 1)\n"
        "    return {'decode_step_us_median': statistics.median(steps) * 1e6,\n"
        "            'other': statistics.median([5.0, 6.0])}\n")
    script = str(ROOT / "benchmarks/vllm_decode_mean.py")
    proc = subprocess.run([sys.executable, script, "--oracle", str(tmp_path), "--models", "full32", "--batch", "8",
                           "--decode-steps", "4", "--repeats", "3", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)
    # Runs (seeds 0-2): first steps 9, 10, 11 ms, then 1 ms: medians 1000 us, means 3000/3250/3500 us.
    assert (row["decode_step_us"], row["decode_step_mean_us"], row["first_step_us"]) == (1000.0, 3250.0, 10000.0)
    bad = subprocess.run([sys.executable, script, "--oracle", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "no replay.py" in bad.stderr


def test_gpu_projection_reports_no_unfused_bytes_where_the_lowering_has_no_cost_analysis():
    """The CUDA lowering's ``cost_analysis()`` is ``None``: the row's ``xla_unfused_bytes`` is then ``None``
    (the first GPU run failed on it), and a CPU lowering's is its bytes accessed."""
    import importlib.util
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("gpu_projection", ROOT / "benchmarks/gpu_projection.py")
    projection = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(projection)
    assert projection._unfused_bytes(SimpleNamespace(cost_analysis=lambda: None)) is None
    assert projection._gb(None) == "n/a"
    lowered = jax.jit(lambda x: x * 2).lower(jnp.zeros(1024, jnp.float32))
    assert projection._unfused_bytes(lowered) >= 2 * 4096
