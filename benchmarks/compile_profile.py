"""Where a tiny model's step programs spend their compile time, and which source lines make their kernels.

Builds the ``hkv demo`` engine of a tiny model (one 64-token bucket), runs one step with XLA's dump of the
step programs, and prints per program: seconds spent tracing (Python), lowering to StableHLO and compiling
(XLA), and the kernels XLA:CPU emits (fusions and copies, each compiled on its own). Then the source lines
and functions that the most kernels come from (XLA's stack frames of each kernel, innermost frame), so a
change that shrinks the allocator's programs can be aimed and checked.

Run: ``python benchmarks/compile_profile.py [--model tiny-gemma3] [--top 25] [--json]``. Set
``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` to see the suite's compile (the test suite compiles at -O0).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

KERNEL = re.compile(r" = \S+ (fusion|copy)\(")


def kernel_sources(text: str) -> collections.Counter:
    """``{"file.py:line function": kernels}`` of an optimized HLO module's text (XLA's dump): each fusion or
    copy counted at the innermost stack frame XLA recorded for it (``"none"``: an instruction XLA made)."""
    def table(name: str, pattern: str) -> list[tuple]:
        found = re.search(rf"^{name}\n((?:\d+ .*\n)*)", text, re.M)
        return re.findall(pattern, found.group(1), re.M) if found else []

    files = dict(table("FileNames", r'^(\d+) "(.*)"$'))
    functions = dict(table("FunctionNames", r'^(\d+) "(.*)"$'))
    locations = {i: (files[f], functions[fn], line) for i, f, fn, line in
                 table("FileLocations", r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")}
    frames = dict(table("StackFrames", r"^(\d+) \{file_location_id=(\d+)"))
    counts = collections.Counter()
    for line in text.splitlines():
        if not KERNEL.search(line):
            continue
        frame = re.search(r"stack_frame_id=(\d+)", line)
        where = locations.get(frames.get(frame.group(1))) if frame else None
        counts["none" if where is None else f"{'/'.join(Path(where[0]).parts[-2:])}:{where[2]} {where[1]}"] += 1
    return counts


class CompileLog(logging.Handler):
    """Collects JAX's ``jax_log_compiles`` lines: seconds per (stage, program)."""

    STAGES = {"tracing": "trace", "jaxpr to MLIR module conversion": "lower", "XLA compilation of": "compile"}

    def __init__(self):
        super().__init__()
        self.seconds = collections.defaultdict(float)

    def emit(self, record):
        m = re.match(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation of) (?:jit\()?(\w+)\)?"
                     r"(?: for jit)? in ([0-9.e-]+) sec", record.getMessage())
        if m:
            self.seconds[self.STAGES[m.group(1)], m.group(2)] += float(m.group(3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gemma3")
    ap.add_argument("--impl", default="auto", help="attention implementation (the suite's engines: reference)")
    ap.add_argument("--top", type=int, default=25, help="source lines and functions to list")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="hkv_compile_profile_")
    # Before jax starts: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit_step --xla_dump_hlo_pass_re=^$").strip()
    import jax

    from hkv_jax.engine.factory import ServeConfig, build_engine

    log = CompileLog()
    logging.getLogger("jax").addHandler(log)
    jax.config.update("jax_log_compiles", True)
    engine, _ = build_engine(ServeConfig(model=args.model, engine={"impl": args.impl}))
    for n in (40, 33):  # a prefill step, then decode steps: the full and the lean program
        engine.add_request(list(range(1, n + 1)), 3)
    engine.run()
    jax.config.update("jax_log_compiles", False)

    programs = []
    for path in sorted(Path(dump).glob("*.jit_step.cpu_after_optimizations.txt")):
        counts = kernel_sources(path.read_text())
        programs.append({"program": path.name.split(".")[0], "kernels": sum(counts.values()), "sources": counts})
    shutil.rmtree(dump, ignore_errors=True)  # read: the dump goes (about 20 MB a run)
    functions = collections.Counter()
    lines = collections.Counter()
    for p in programs:
        lines.update(p["sources"])
        for where, n in p["sources"].items():
            file, _, function = where.partition(" ")
            functions[f"{file.split(':')[0]} {function}".strip()] += n
    stages = {stage: round(sum(s for (st, _), s in log.seconds.items() if st == stage), 2)
              for stage in ("trace", "lower", "compile")}
    step = {stage: round(log.seconds[stage, "step"], 2) for stage in ("trace", "lower", "compile")}
    if args.json:
        print(json.dumps({"model": args.model, "optimizations": os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "0"),
                          "seconds": stages, "step_seconds": step,
                          "kernels": [p["kernels"] for p in programs],
                          "top_functions": functions.most_common(args.top)}))
        return 0
    print(f"{args.model}: every program: trace {stages['trace']:.1f} s, lower {stages['lower']:.1f} s, "
          f"compile {stages['compile']:.1f} s; the step programs: trace {step['trace']:.1f} s, "
          f"lower {step['lower']:.1f} s, compile {step['compile']:.1f} s")
    print("kernels per step program:", ", ".join(f"{p['program']} {p['kernels']}" for p in programs))
    for title, table in (("functions", functions), ("source lines", lines)):
        print(f"\nkernels by {title} (all step programs):")
        for where, n in table.most_common(args.top):
            print(f"{n:6d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
