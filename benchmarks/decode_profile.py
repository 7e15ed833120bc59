"""Where a decode step goes on this machine's device: wall time, device busy time, kernels, the top kernels.

Serves ``--config`` (``gpu_projection.py``'s models with random weights, or a ``tiny-*`` preset) to
``--batch`` requests prefilled to ``--context`` tokens, times ``--calls`` calls of ``decode_steps`` decode
steps each (the median per step after two warm calls), then records a profiler trace
(``jax.profiler``, perfetto) of ``--traced-calls`` more calls and reads it:

- ``gpu_busy_ms``: per step, the union of the intervals in which the device ran anything (kernels and
  copies on any stream of a ``/device:*`` process);
- ``kernels_per_step``: device events that are not copies or memsets, per step;
- ``d2h_per_step`` and ``d2h_wait_us_median``: device-to-host copies per step (each conditional's and
  the loop's predicate, unless XLA runs them in a CUDA graph; a call's reports) and the median time the
  device then sits idle;
- ``top``: the kernels with the most device time (name, calls per step, microseconds per step);
- ``setup_s``: building the model and engine, compiling and prefilling: the start to the first token. The
  pool holds each request's blocks and, beside a sliding window or local chunk, a step's chunk of the prompt
  (``gpu_projection.blocks_per_request``), so the prompt prefills in ``prefill_steps`` steps of the token
  budget. (Over a pool of the windows alone, the scheduler cuts a long prompt into the small steps that fit
  them, and a short last step compiles one more step program before the first token.)
  ``setup_compiled`` and ``setup_loaded``: the programs that start compiled, and those it loaded from JAX's
  persistent compilation cache instead (``JAX_COMPILATION_CACHE_DIR``); the engine's shapes do not depend on
  ``--calls`` (``gpu_projection.DECODE_ROOM``), so a second start compiles none.

``--traced-calls 0`` records no trace: the wall time alone (kernels that run inside XLA's CUDA graphs lose
their names in a trace); ``xla_flags`` keeps the ``XLA_FLAGS`` the run had. On
a CPU the trace has no device process: the device fields are ``None`` and only the wall time is measured
(``--smoke`` runs that way, so that CI keeps the script working). ``--trace FILE`` summarises a trace
written before instead (``*.trace.json.gz``). Run: ``python benchmarks/decode_profile.py
--config gemma-3-270m --batch 1 --context 1024 [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from gpu_projection import decode_engine, timed_decode_calls  # noqa: E402

COPIES = ("Memcpy", "Memset", "memcpy", "memset")
# XLA compile requests (a load from the persistent cache among them) and loads, counted as JAX reports them.
COMPILE_EVENT, CACHE_HIT_EVENT = "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"
EVENTS = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: EVENTS.update([event]))
jax.monitoring.register_event_duration_secs_listener(lambda event, _secs, **_: EVENTS.update([event]))


def device_events(trace: dict | list) -> list[dict]:
    """The complete events (``ph == "X"``) of the trace's device processes (named ``/device:...``)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]


def summarise(events: list[dict], steps: int, top: int = 10) -> dict:
    """Busy milliseconds, kernels and the top kernels per step of ``steps`` steps' device ``events``; the
    device-to-host copies per step (a conditional's or a loop's predicate, the reports) and the median idle
    gap after one (the device waiting for the host to read it and launch what follows)."""
    busy, end, last, waits = 0.0, float("-inf"), None, []
    for e in sorted(events, key=lambda e: e["ts"]):  # the union of [ts, ts + dur)
        lo, hi = e["ts"], e["ts"] + e.get("dur", 0)
        if lo > end and last is not None and last["name"].startswith("MemcpyD2H"):
            waits.append(lo - end)
        busy += max(0.0, hi - max(lo, end))
        if hi >= end:
            end, last = hi, e
    kernels = [e for e in events if not e["name"].startswith(COPIES)]
    time_of, calls = collections.Counter(), collections.Counter()
    for e in kernels:
        time_of[e["name"]] += e.get("dur", 0)
        calls[e["name"]] += 1
    d2h = sum(e["name"].startswith("MemcpyD2H") for e in events)
    return {"gpu_busy_ms": round(busy / steps / 1e3, 4), "kernels_per_step": round(len(kernels) / steps, 1),
            "d2h_per_step": round(d2h / steps, 1),
            "d2h_wait_us_median": round(statistics.median(waits), 1) if waits else None,
            "top": [{"kernel": name, "calls_per_step": round(calls[name] / steps, 2),
                     "us_per_step": round(us / steps, 2)} for name, us in time_of.most_common(top)]}


def read_trace(path: str) -> dict | list:
    with gzip.open(path) as f:
        return json.load(f)


def profile(config: str, batch: int, context: int, decode_steps: int, calls: int, traced_calls: int,
            top: int) -> dict:
    """The row for one configuration, on this machine's device."""
    t0, before = time.perf_counter(), EVENTS.copy()
    eng = decode_engine(config, batch, context, decode_steps, calls + traced_calls)
    setup, prefill_steps = time.perf_counter() - t0, eng.stats.steps
    counted = EVENTS - before
    loaded = counted[CACHE_HIT_EVENT]
    compiled = counted[COMPILE_EVENT] - loaded
    print(f"# {config} B={batch} ctx={context}: engine built, compiled and prefilled ({prefill_steps} steps, "
          f"step programs {sorted(eng.stats.bucket_steps)}; {compiled} programs compiled, {loaded} loaded from "
          f"the cache) in {setup:.1f} s", file=sys.stderr, flush=True)
    times = timed_decode_calls(eng, calls, decode_steps)
    row = {"bench": "decode_profile", "config": config, "batch": batch, "context": context,
           "decode_steps": decode_steps, "device": jax.devices()[0].device_kind, "setup_s": round(setup, 1),
           "prefill_steps": prefill_steps, "setup_compiled": compiled, "setup_loaded": loaded,
           "xla_flags": os.environ.get("XLA_FLAGS") or None,
           "step_ms": round(statistics.median(times[2:] or times) * 1e3, 3), "gpu_busy_ms": None,
           "kernels_per_step": None, "d2h_per_step": None, "d2h_wait_us_median": None, "top": []}
    if not traced_calls:
        return row
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(traced_calls):
                eng.step_tokens()
            jax.block_until_ready(eng.state)
        files = sorted(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True))
        events = device_events(read_trace(files[-1])) if files else []
    if events:
        row.update(summarise(events, traced_calls * decode_steps, top))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gemma-3-270m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=4, help="decode steps per call (the engine's decode_steps)")
    p.add_argument("--calls", type=int, default=12, help="timed calls")
    p.add_argument("--traced-calls", type=int, help="calls traced after the timed ones (default 3; --smoke: 1)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--trace", help="summarise this perfetto trace (*.trace.json.gz) instead of running")
    p.add_argument("--steps", type=int, help="with --trace: the decode steps the trace holds")
    p.add_argument("--smoke", action="store_true", help="tiny-gptoss, B=1, 100 tokens, 3 calls (CI on CPU)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.trace:
        if not a.steps:
            p.error("--trace needs --steps")
        row = summarise(device_events(read_trace(a.trace)), a.steps, a.top)
    else:
        if a.smoke:
            a.config, a.batch, a.context, a.decode_steps, a.calls = "tiny-gptoss", 1, 100, 2, 3
        a.traced_calls = (1 if a.smoke else 3) if a.traced_calls is None else a.traced_calls
        if min(a.batch, a.context, a.decode_steps, a.calls) < 1 or a.traced_calls < 0:
            p.error("--batch, --context, --decode-steps and --calls must be positive, --traced-calls not negative")
        row = profile(a.config, a.batch, a.context, a.decode_steps, a.calls, a.traced_calls, a.top)
        print(f"{a.config} B={a.batch} ctx={a.context}: {row['step_ms']:.3f} ms a step on {row['device']}",
              file=sys.stderr)
    if row["gpu_busy_ms"] is not None:
        print(f"device busy {row['gpu_busy_ms']:.3f} ms a step, {row['kernels_per_step']} kernels a step, "
              f"{row['d2h_per_step']} reads to the host a step (the device idle {row['d2h_wait_us_median']} us "
              "after one, median); top:", file=sys.stderr)
        for k in row["top"]:
            print(f"  {k['us_per_step']:9.2f} us {k['calls_per_step']:6.2f}x  {k['kernel'][:100]}", file=sys.stderr)
    else:
        print("no device events traced (a CPU, or --traced-calls 0): device busy time and kernels not measured",
              file=sys.stderr)
    if a.json:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
