"""Where a Gemma 3 270M serving step spends its time: a ``jax.profiler`` trace of a few steps, summed by
XLA operation kind (``ynn_fusion``, ``copy``, ``while``, ...).

Workload: C requests of the first ``--prompt-tokens`` tokens of the reference prompts
(``tests/data/gemma3_270m_reference.json``, cycled), each generating up to 200 tokens; after
``--warm-up`` untimed steps (prefill and compiles; more until a step compiles nothing), ``--steps``
decode steps are traced. Prints the wall
time per step and, per operation kind, milliseconds and events per step. Events of the thunk executor
overlap when it runs thunks side by side, so their sum can exceed the wall time.

``--kv-cache-dtype fp8|bfloat16|...``: the attention layers' pages (``EngineConfig.kv_cache_dtype``).

``--host-cache BYTES``: a host tier of that size (``EngineConfig.host_cache_bytes``).

``--model tiny-gemma3`` (or another tiny preset: random weights, the prompts' ids modulo its vocabulary) is
the smallest mode the suite runs.

``--top-logprobs N``: every request asks for its ``N`` likeliest tokens per step
(``Engine(max_top_logprobs=N)``), the cost of a ``top_k`` over the vocabulary.

Run: ``python benchmarks/profile_steps.py [--concurrency 32] [--decode-steps 1] [--quantize int8]
[--top-logprobs 5] [--kv-cache-dtype fp8] [--host-cache BYTES]``; needs the ``gemma`` extra. Traces go to a
temporary directory (``--trace-dir`` keeps them).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
from real_model import REFERENCE

from hkv_jax.engine import Engine
from hkv_jax.engine.factory import engine_config, engine_for, load_model
from hkv_jax.models.quant import QUANTIZE


def op_times(trace_dir: str) -> collections.Counter:
    """``{kind: (total ns, events)}`` over every event of the trace, the numeric suffix of XLA names dropped."""
    path = next(Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
    out = collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                kind = re.sub(r"\.\d+.*", "", ev.name)
                out[kind][0] += ev.duration_ns
                out[kind][1] += 1
    return out


def main(argv=None) -> int:
    """Trace and print (``--json``: one JSON object)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m", help="gemma-3-270m (default) or a tiny preset")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=1)
    ap.add_argument("--quantize", choices=QUANTIZE)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the attention layers' pages (EngineConfig)")
    ap.add_argument("--top-logprobs", type=int, default=0, help="likeliest tokens each request asks for per step")
    ap.add_argument("--warm-up", type=int, default=40, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=16, help="decode steps traced (at least)")
    ap.add_argument("--top", type=int, default=15, help="operation kinds printed")
    ap.add_argument("--host-cache", type=int, default=0, help="bytes of host tier (EngineConfig.host_cache_bytes)")
    ap.add_argument("--trace-dir")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model, codec = load_model(args.model, quantize=args.quantize, progress=not args.json)
    vocab = model.cfg.vocab_size
    prompts = [[t % vocab for t in p["ids"][:args.prompt_tokens]] for p in json.loads(REFERENCE.read_text())["prompts"]]
    engine = engine_for(model, codec, engine_config(
        model, max_model_len=args.prompt_tokens + 200, max_requests=args.concurrency, token_budget=args.token_budget,
        decode_steps=args.decode_steps, max_top_logprobs=args.top_logprobs, kv_cache_dtype=args.kv_cache_dtype,
        host_cache_bytes=args.host_cache))
    for i in range(args.concurrency):
        engine.add_request(prompts[i % len(prompts)], 200, top_logprobs=args.top_logprobs)
    fresh = True  # until a step compiles nothing: compiles would swamp the trace
    while engine.stats.steps < args.warm_up or fresh:
        compiled = Engine.compilations()
        engine.step()
        fresh = Engine.compilations() != compiled
    compiled = Engine.compilations()
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="hkv_profile_")
    jax.profiler.start_trace(trace_dir)
    s0, t0 = engine.stats.steps, time.perf_counter()
    while engine.stats.steps - s0 < args.steps:
        engine.step()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    n = engine.stats.steps - s0
    if Engine.compilations() != compiled:
        print("warning: the traced steps compiled a program (raise --warm-up)", file=sys.stderr)
    ops = sorted(op_times(trace_dir).items(), key=lambda kv: -kv[1][0])
    if not args.trace_dir:  # read: the temporary trace goes (about 8 MB a run)
        shutil.rmtree(trace_dir, ignore_errors=True)
    result = {"model": args.model, "concurrency": args.concurrency, "decode_steps": args.decode_steps,
              "quantize": args.quantize, "kv_cache_dtype": args.kv_cache_dtype, "prompt_tokens": args.prompt_tokens,
              "top_logprobs": args.top_logprobs,
              "steps": n, "wall_ms_per_step": round(wall / n * 1e3, 1),
              "ops": [{"kind": k, "ms_per_step": round(ns / n / 1e6, 2), "events_per_step": round(c / n, 1)}
                      for k, (ns, c) in ops[:args.top]]}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    kept = f"; trace in {trace_dir}" if args.trace_dir else ""
    print(f"{n} steps, {result['wall_ms_per_step']} ms per step (wall){kept}")
    for op in result["ops"]:
        print(f"{op['ms_per_step']:10.2f} ms/step  x{op['events_per_step']:7.1f}  {op['kind']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
