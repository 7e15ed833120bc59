"""vLLM 0.33's decode step on ``allocator_step.py``'s workload, as the median *and the mean* of the steps.

The vLLM oracle's ``replay.py --bench`` (in ``shared/tools/vllm_oracle``, outside this repository: a
development tool) reports the median decode step. That median leaves out the steps that cost most: the
first decode step after the prefill (sliding-window groups free every block that left the window) and
the steps where every request takes a block. ``engine_step.py``'s multi-step path spreads such steps
over the steps of their call, so its figures compare with vLLM's mean, which this script adds. It runs
the oracle's own ``bench_one`` unchanged and only records the step times the oracle takes the median of.

The models are ``bench_models.py``'s (the oracle's own, and gemma4, added to its list here).
Run with the oracle's Python: ``~/.vllm-oracle/bin/python benchmarks/vllm_decode_mean.py
--oracle ../shared/tools/vllm_oracle [--models full32,gemma3,gptoss,gemma4] [--batch 256,1024]
[--decode-steps 32] [--repeats 3] [--json]``. Each figure is the median over the repeats (seeds 0, 1, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

from bench_models import MODELS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--oracle", required=True, help="the vLLM oracle's folder (it holds replay.py)")
    p.add_argument("--models", default="full32,gemma3,gptoss")
    p.add_argument("--batch", default="256,1024")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (Path(a.oracle) / "replay.py").is_file():
        p.error(f"--oracle: no replay.py in {a.oracle!r}")
    if a.decode_steps < 1 or a.repeats < 1:
        p.error("--decode-steps and --repeats: at least 1")
    sys.path.insert(0, str(Path(a.oracle).resolve()))
    import replay  # the oracle: imports vLLM (about 10 s)

    for name, pattern in MODELS.items():  # ours and the oracle's must be the same workload
        theirs = replay.BENCH_MODELS.setdefault(name, {"layer_pattern": pattern})
        if theirs["layer_pattern"] != pattern:
            p.error(f"model {name}: the oracle's layer pattern differs from bench_models.py's")

    recorded: list[list[float]] = []

    def median(xs):  # the oracle's first median call in bench_one is over the decode step times
        recorded.append(list(xs))
        return statistics.median(xs)

    replay.statistics = types.SimpleNamespace(median=median)
    rows = []
    for m in a.models.split(","):
        for b in map(int, a.batch.split(",")):
            runs = []
            for seed in range(a.repeats):
                print(f"... {m} B={b} run {seed + 1}/{a.repeats}", file=sys.stderr, flush=True)
                recorded.clear()
                replay.bench_one(m, b, 2048, a.decode_steps, 16, True, 0, seed)
                runs.append(recorded[0])
            def us(f):
                return round(statistics.median(f(r) for r in runs) * 1e6, 1)
            rows.append({"model": m, "batch": b, "decode_steps": a.decode_steps,
                         "decode_step_us": us(statistics.median), "decode_step_mean_us": us(statistics.mean),
                         "first_step_us": us(lambda r: r[0])})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"vLLM {replay.vllm.__version__}, {a.decode_steps} decode steps, median of {a.repeats} runs")
    print(f"{'model':<8} {'B':>5} {'median us':>10} {'mean us':>10} {'first step us':>14}")
    for r in rows:
        print(f"{r['model']:<8} {r['batch']:>5} {r['decode_step_us']:>10} {r['decode_step_mean_us']:>10} "
              f"{r['first_step_us']:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
