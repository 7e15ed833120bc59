"""The benchmark scripts keep running: their ``--smoke`` modes on CPU (times are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_session_smoke_runs_every_step_and_writes_the_results_file(tmp_path):
    """``SMOKE=1 gpu_session.sh``: part 1's steps at their smallest on CPU (attention kernels in interpret mode),
    each under its timeout, then the results file from what they wrote."""
    env = {**os.environ, "SMOKE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_session.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = (tmp_path / "steps.txt").read_text().splitlines()
    assert len(steps) == 6 and all(": exit 0 after" in line for line in steps), steps
    # attention_gpu.py checked and timed every implementation; the split kernel says into how many runs.
    log = (tmp_path / "attention_decode.jsonl.log").read_text()
    assert "WRONG" not in log and "cannot run" not in log, log[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "attention_decode.jsonl").read_text().splitlines()]
    assert {r["impl"] for r in rows} == {"ours", "triton", "xla", "mosaic_gpu", "mosaic_gpu_nosplit", "jax"}
    assert all(r["time_us"] > 0 and r["bytes"] > 0 for r in rows)
    assert all(r["splits"] >= 1 for r in rows if r["impl"] == "mosaic_gpu")
    # decode_profile.py ran; a CPU's trace has no device process.
    assert "not measured" in (tmp_path / "decode_profile_cold.json.log").read_text()
    results = json.loads(next((tmp_path / "results").glob("cpu-*.json")).read_text())
    assert results["commit"] != "unknown" and results["jax"]
    by = {}
    for r in results["rows"]:
        by.setdefault(r["bench"], []).append(r)
    assert len(by["attention_decode"]) == len(rows)
    [parity] = by["parity"]
    assert parity["tokens_equal"] == parity["requests"] == 2 and parity["all_freed"]
    [profile] = by["decode_profile"]  # the smoke has no CUDA graphs step
    assert profile["config"] == "tiny-gptoss" and profile["step_ms"] > 0 and profile["gpu_busy_ms"] is None
    [start] = by["startup"]
    assert 0 < start["warm_s"] and 0 < start["cold_s"]
    # The cold start compiled every program itself (no other step's left in its cache), and the warm one
    # (other calls, no trace) loaded them all and compiled none.
    assert start["warm_loaded"] == start["cold_compiled"] > 0 and start["warm_compiled"] == 0
    # The profile's pool holds a step's chunk beside each sliding window: its 99-token prompt (tiny-gptoss's
    # window is 16 tokens) prefills in one step (6 over a pool of the windows alone).
    assert start["prefill_steps"] == 1
    # gpu_hlo.py counted the decode program the cold profile dumped (XLA:CPU's here): a while loop's step.
    [hlo] = by["hlo_kernels"]
    assert hlo["config"] == "tiny-gptoss" and hlo["kernels_per_step"] > 0 and hlo["compiled_for"].startswith("module")
    assert hlo["command_buffers"] is None  # XLA:CPU writes no thunk sequence
    # host_copy.py moved pages both ways (it checks a moved page) and timed them.
    [copy] = by["host_copy"]
    assert copy["blocks"] == 2 and copy["down_gb_per_s"] > 0 and copy["up_gb_per_s"] > 0


def test_attention_gpu_prefill_smoke_checks_and_times_both_warpgroup_forms(capsys):
    """``attention_gpu.py --smoke --mode prefill``: every implementation checked against the reference, then
    timed with TFLOP/s; the Mosaic GPU rows say how they ran (interpret mode: one warpgroup)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_gpu

    assert attention_gpu.main(["--smoke", "--mode", "prefill", "--json"]) == 0
    out = capsys.readouterr()
    assert "WRONG" not in out.err and "cannot run" not in out.err, out.err[-2000:]
    rows = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert {r["impl"] for r in rows} == {"ours", "triton", "xla", "mosaic_gpu_1wg"}
    assert all(r["mode"] == "prefill" and r["time_us"] > 0 and r["tflops"] >= 0 for r in rows)
    assert all(r["warpgroups"] == 1 and r["splits"] >= 1 for r in rows if r["impl"].startswith("mosaic_gpu"))
    # On an H200 (132 SMs, also assumed without a GPU) a batch of 8 prefill chunks takes two warpgroups a
    # program, and a lone chunk, whose 9 items x 8 KV heads would leave 60 SMs idle, one.
    assert attention_gpu.mosaic_form(8, 256, 32768, 16) == {"splits": 1, "warpgroups": 2}
    assert attention_gpu.mosaic_form(1, 256, 4096, 16) == {"splits": 1, "warpgroups": 1}


def test_attention_gpu_window_smoke_bounds_the_bytes_and_times_the_table_bounded_split(capsys):
    """``attention_gpu.py --smoke --mode decode --window 24`` (the implementations ``gpu_session.sh`` times
    under it): each checked under the window, the Mosaic GPU kernel also timed with its runs bounded by the
    table; bytes count the pages the window covers (2 of each sequence's 4). JAX's kernel has no window, and
    ``--impls`` refuses a name it does not have."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention_gpu

    impls = ["--impls", "ours,mosaic_gpu,mosaic_gpu_table_splits"]
    assert attention_gpu.main(["--smoke", "--mode", "decode", "--window", "24", *impls, "--json"]) == 0
    out = capsys.readouterr()
    assert "WRONG" not in out.err and "cannot run" not in out.err, out.err[-2000:]
    rows = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [r["impl"] for r in rows] == ["ours", "mosaic_gpu", "mosaic_gpu_table_splits"]
    assert all(r["window"] == 24 and r["time_us"] > 0 for r in rows)
    assert {r["bytes"] for r in rows} == {attention_gpu.case_bytes(2, 64, 16, 2, window=24)}
    assert attention_gpu.case_bytes(2, 64, 16, 2, window=24) < attention_gpu.case_bytes(2, 64, 16, 2)
    assert attention_gpu.case_bytes(1, 100, 16, 1, window=24) == attention_gpu.case_bytes(1, 48, 16, 1)  # 3 pages
    with pytest.raises(SystemExit):
        attention_gpu.main(["--smoke", "--mode", "decode", "--window", "24", "--impls", "jax"])
    assert "--impls: no jax for decode here" in capsys.readouterr().err


def test_gpu_results_joins_the_sessions_two_parts_and_names_the_device_that_measured(tmp_path):
    """Part 2 of ``gpu_session.sh`` (the projection) runs in a device call of its own: ``gpu_results.py`` takes
    both folders into one file, and part 2's folder alone still names its device. A wrong part is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_results

    one, two, into = (tmp_path / name for name in ("one", "two", "into"))
    one.mkdir(), two.mkdir()
    (one / "parity.jsonl").write_text(json.dumps({"model": "tiny-gemma3", "device": "NVIDIA H100 80GB HBM3",
                                                  "tokens_equal": 4, "requests": 4}) + "\n")
    projected = {"config": "llama-3.1-8b-like", "device": "h200", "batch": 64, "context": 4096, "projected_ms": 9.0}
    (two / "projection.json").write_text(json.dumps({"rows": [
        {**projected, "measured_ms": 10.5, "measured_on": "NVIDIA H200"}, {**projected, "batch": 1}]}) + "\n")
    (two / "window_decode.jsonl").write_text(json.dumps({"mode": "decode", "impl": "mosaic_gpu", "batch": 1,
                                                         "context": 32768, "window": 512, "splits": 9}) + "\n")
    assert gpu_results.main([str(one), str(two), "--into", str(into), "--commit", "abc"]) == 0
    [both] = into.glob("*.json")
    got = json.loads(both.read_text())
    assert both.name.startswith("h100-") and got["device"] == "NVIDIA H100 80GB HBM3"  # part 1's, read first
    assert [r["bench"] for r in got["rows"]] == ["parity", "projection", "attention_window"]  # unmeasured: out
    assert got["rows"][2]["window"] == 512 and got["rows"][2]["splits"] == 9
    assert got["rows"][1]["measured_ms"] == 10.5 and got["rows"][1]["measured_on"] == "NVIDIA H200"
    both.unlink()
    assert gpu_results.main([str(two), "--into", str(into)]) == 0
    [alone] = into.glob("*.json")
    assert alone.name.startswith("h200-") and json.loads(alone.read_text())["device"] == "NVIDIA H200"
    bad = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_session.sh"), str(one), "3"], capture_output=True,
                         text=True, timeout=30, cwd=ROOT)
    assert bad.returncode == 2 and "PART must be 1, 2 or all" in bad.stderr


def test_decode_profile_reads_device_busy_time_and_kernels_from_a_trace():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from decode_profile import device_events, summarise

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]

    def ev(pid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": 7, "name": name, "ts": ts, "dur": dur}
    # Two streams overlapping in [12, 15): busy 10-20 and 30-31 = 11 us; the host's event is not the device's.
    trace = {"traceEvents": meta + [ev(1, "attn", 10, 5), ev(1, "norm", 12, 8), ev(1, "MemcpyD2H", 30, 1),
                                    ev(1, "attn", 40, 0), ev(2, "python", 0, 100)]}
    row = summarise(device_events(trace), steps=2, top=1)
    assert row["gpu_busy_ms"] == round(11 / 2 / 1e3, 4)
    assert row["kernels_per_step"] == 1.5  # 3 kernels (the copy is not one) over 2 steps
    assert row["top"] == [{"kernel": "norm", "calls_per_step": 0.5, "us_per_step": 4.0}]
    assert row["d2h_per_step"] == 0.5 and row["d2h_wait_us_median"] == 9.0  # idle from 31 to 40


def test_compile_profile_counts_each_kernel_at_its_innermost_source_line():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compile_profile import kernel_sources

    # XLA's dump: the stack frame tables, then the module; frame 3's innermost location is free_queue.py:107.
    text = "\n".join([
        "HloModule jit_step", "", "FileNames", '1 "/r/hkv_jax/engine/step.py"',
        '2 "/r/hkv_jax/allocator/free_queue.py"',
        "FunctionNames", '1 "step"', '2 "compact"',
        "FileLocations", "1 {file_name_id=1 function_name_id=1 line=40 end_line=40}",
        "2 {file_name_id=2 function_name_id=2 line=107 end_line=107}",
        "StackFrames", "1 {file_location_id=1 parent_frame_id=1}", "2 {file_location_id=2 parent_frame_id=1}",
        "3 {file_location_id=2 parent_frame_id=2}", "",
        "%fused_computation (p: s32[4]) -> s32[4] {",
        "  %add.1 = s32[4]{0} add(%p, %p), metadata={stack_frame_id=3}",
        "}", "ENTRY %main {",
        '  %f.1 = s32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="x" stack_frame_id=3}',
        "  %f.2 = s32[4]{0} fusion(%f.1), kind=kLoop, calls=%fused_computation, metadata={stack_frame_id=1}",
        "  %c.3 = s32[4]{0} copy(%f.2)",
        "  %d.4 = s32[4]{0} dynamic-slice(%c.3), metadata={stack_frame_id=3}",
        "}"])
    assert kernel_sources(text) == {"allocator/free_queue.py:107 compact": 1, "engine/step.py:40 step": 1, "none": 1}


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



SYNTHETIC_DECODE_MODULE = """HloModule decode_steps

%fused_a (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}

%idle (t: f32[2]) -> f32[2] {
  %t = f32[2]{0} parameter(0)
  ROOT %k = f32[2]{0} fusion(%t), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/add"}
}

%busy (t: f32[2]) -> f32[2] {
  %t = f32[2]{0} parameter(0)
  %k1 = f32[2]{0} fusion(%t), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/add"}
  %k2 = f32[2]{0} fusion(%k1), kind=kInput, calls=%fused_a, metadata={op_name="jit(decode_steps)/cond/sort"}
  ROOT %k3 = f32[2]{0} custom-call(%k2), custom_call_target="xla.gpu.ext.cub_sort_pairs"
}

%forward (t: f32[2]) -> f32[2] {
  %t = f32[2]{0} parameter(0)
  %norm = f32[2]{0} fusion(%t), kind=kInput, calls=%fused_a, metadata={op_name="jit(decode_steps)/reduce_sum"}
  %attn = f32[2]{0} custom-call(%norm), custom_call_target="mosaic_gpu_v2"
  %mm = f32[2] fusion(%attn), kind=kCustom, calls=%fused_a, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %act = f32[2]{0} fusion(%mm), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/mul"}
  %mm2 = f32[2] fusion(%act), kind=kCustom, calls=%fused_a, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  ROOT %out = f32[2]{0} fusion(%mm2), kind=kInput, calls=%fused_a, metadata={op_name="jit(decode_steps)/reduce_sum"}
}

%skip (t: f32[2]) -> f32[2] {
  %t = f32[2]{0} parameter(0)
  ROOT %c = f32[2]{0} copy(%t)
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], /*index=1*/f32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %path = s32[] fusion(%i), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/select_n"}
  %a = f32[2]{0} conditional(%path, %x, %x), branch_computations={%idle, %busy}
  %ran = pred[] fusion(%i), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/ne"}
  %y = f32[2]{0} conditional(%ran, %a, %a), true_computation=%forward, false_computation=%skip
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %y)
}

%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], /*index=1*/f32[2]{0}) parameter(0)
  ROOT %go = pred[] fusion(%t), kind=kLoop, calls=%fused_a, metadata={op_name="jit(decode_steps)/lt"}
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %init = (s32[], /*index=1*/f32[2]{0}) fusion(%x), kind=kLoop, calls=%fused_a
  %w = (s32[], /*index=1*/f32[2]{0}) while(%init), condition=%cond, body=%body
  ROOT %y = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_gpu_hlo_counts_a_decode_step_through_its_usual_and_its_largest_branches():
    """``gpu_hlo.py``'s reading of an optimised module: one ``while`` iteration (body and condition, not the
    entry's kernels); a step where no block moves takes the allocator's smallest branch and the forward
    pass (the branch of at least half the most kernels); the largest path takes every largest branch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_hlo import decode_step_counts, layer_kernels, opcode, summary, target_config

    assert opcode("%w = (s32[], /*index=1*/f32[2]{0}) while(%init), condition=%c, body=%b") == "while"
    assert opcode("ROOT %y = f32[2]{0} get-tuple-element(%w), index=1") == "get-tuple-element"
    usual, most = decode_step_counts(SYNTHETIC_DECODE_MODULE, "decode_steps")
    row = summary(usual, most, top=3)
    # path select + idle + ran + 6 forward kernels + the loop condition; the skip branch's copy is not taken
    assert row["kernels_per_step"] == 10 and row["copies_per_step"] == 0
    assert row["conditionals_per_step"] == 2 and row["loops_per_step"] == 0
    assert row["kernels_most"] == 12 and row["conditionals_most"] == 2
    labels = {k["kernel"]: k["per_step"] for k in summary(usual, most, top=20)["top"]}
    assert labels["kInput reduce_sum"] == 2 and labels["custom-call mosaic_gpu_v2"] == 1
    assert labels["kCustom __triton"] == 2 and "custom-call xla.gpu.ext.cub_sort_pairs" not in labels
    assert layer_kernels(SYNTHETIC_DECODE_MODULE) == ["custom-call mosaic_gpu_v2", "kCustom __triton", "kLoop mul",
                                                      "kCustom __triton", "kInput reduce_sum"]
    whole, whole_most = decode_step_counts(SYNTHETIC_DECODE_MODULE, "step")  # the entry: init, the loop once
    assert (whole["#kernels"], whole_most["#kernels"], whole["#loops"]) == (11, 13, 1)
    h200 = target_config("h200")
    assert "core_count: 132" in h200 and "cuda_compute_capability { major: 9" in h200
    # A CUDA driver and toolkit of 12.3 or later, or XLA records no attention kernel, loop or conditional
    # in a CUDA graph (the counts then differ from the GPU's own).
    assert 'driver_version: "13.0.0"' in h200 and "runtime_version { major: 13" in h200


# XLA's thunk sequence, as it dumps it: a command buffer, then a loop whose body holds a conditional in a
# command buffer and a conditional outside any (whose branch holds a loop).
SYNTHETIC_THUNKS = """\
000: kCommandBuffer [source       | next=015 (1)]
    001: kCopy         [source       | sink        ] kCopy
    013: kConditional  [prev=004 (3) | next=014 (1)]
      true_branch:
        No thunks.
015: kWhile         [prev=000 (1) | sink        ]
condition:
    No thunks.  body:
    000: kCommandBuffer [source       | next=273 (1)]
        016: kCustomKernel [source       | sink        ] loop_select_fusion grid: [1, 1, 1]
    273: kConditional   [prev=000 (1) | sink        ]
      branch_0:
        106: kWhile         [source       | sink        ]
"""


def test_gpu_hlo_counts_the_loops_and_conditionals_outside_xlas_command_buffers():
    """A loop or conditional counts as outside unless a command buffer encloses it (by indentation): the
    top loop, the conditional in its body and the loop in that conditional's branch; none once one command
    buffer holds the whole sequence."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_hlo import graph_counts

    assert graph_counts(SYNTHETIC_THUNKS) == {"command_buffers": 2, "control_outside_graphs": 3}
    inside = "000: kCommandBuffer [source | sink]\n" + "".join(f"    {line}\n" for line in SYNTHETIC_THUNKS.split("\n"))
    assert graph_counts(inside) == {"command_buffers": 3, "control_outside_graphs": 0}


def test_fp8_quality_benchmark_reads_one_text_through_fp8_and_reference_pages(tmp_path, capsys):
    """``kv_fp8_quality.py`` in its smallest mode (tiny-gemma3, 96 byte tokens in 32-token chunks, past its
    32-token window): both perplexities and the agreement come from the same positions, and the fp8 pages
    move the logits (a little: the perplexities within a factor of 1.5). Then 4 greedy tokens after each
    prompt longer than the window (two of three), through each cache."""
    import importlib.util
    import math

    text = tmp_path / "text.txt"
    text.write_text("A paged KV cache keeps each request's keys and values in fixed-size blocks. " * 3)
    spec = importlib.util.spec_from_file_location("kv_fp8_quality", ROOT / "benchmarks/kv_fp8_quality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"ids": list(range(40, 80))}, {"ids": [7] * 10},
                                               {"ids": list(b"paged " * 7)}]}))
    assert bench.main(["--model", "tiny-gemma3", "--tokens", "96", "--chunk", "32", "--text", str(text),
                       "--prompts", str(prompts), "--generate", "4", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["tokens"], row["ref_dtype"], row["fp8_dtype"]) == (96, "float32", "float8_e4m3fn")
    assert row["key_centres"]  # calibrated as build_engine does
    assert 1 < row["ppl_ref"] < math.inf and 0 < row["teacher_forced_agreement"] <= 1 and row["max_logit_err"] > 0
    assert row["prompts"] == [40, 42] and row["generated"] == 4 and len(row["first_difference"]) == 2
    assert row["greedy_agreement"] == sum(4 if d is None else d for d in row["first_difference"]) / 8
    assert abs(math.log(row["ppl_fp8"] / row["ppl_ref"])) < math.log(1.5)


def test_matmul_benchmark_times_float32_and_int8_products(capsys):
    """``matmul_cpu.py`` in its smallest mode: one shape, two row counts, one timed call each."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import matmul_cpu

    assert matmul_cpu.main(["--shapes", "mlp up", "--rows", "1,2", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["shape"], r["rows"]) for r in rows] == [("mlp up", 1), ("mlp up", 2)]
    assert all(r["float32_ms"] > 0 and r["int8_ms"] > 0 for r in rows) and rows[0]["int8_unpadded_ms"] > 0


def test_profile_steps_traces_decode_steps_by_operation_kind(capsys):
    """``profile_steps.py`` in its smallest mode (tiny-gemma3, one request): a trace of a decode step summed by
    operation kind (about 20 s, the step programs' compiles)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_steps

    assert profile_steps.main(["--model", "tiny-gemma3", "--concurrency", "1", "--prompt-tokens", "8",
                               "--token-budget", "16", "--warm-up", "1", "--steps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "tiny-gemma3" and result["steps"] >= 1 and result["wall_ms_per_step"] > 0
    assert result["ops"] and all(op["ms_per_step"] >= 0 and op["events_per_step"] > 0 for op in result["ops"])
