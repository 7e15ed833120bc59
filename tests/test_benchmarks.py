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
