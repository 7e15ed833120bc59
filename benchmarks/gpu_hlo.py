"""The kernels XLA:GPU makes of a decode step, read on any machine: the engine's decode program compiled
for an H200 (or H100) without one, and its optimised HLO counted.

A CUDA-enabled jaxlib compiles for a GPU it does not have when it is given the device's description
(``target_config``: SM count, shared memory, bandwidth, compute capability 9.0); the compile stops short of
loading the program, and its optimised module (``XLA_FLAGS=--xla_dump_to``) is what the GPU would run. On a
machine with a GPU the script compiles for that one. It serves ``--config`` (``gpu_projection.py``'s models, or
a ``tiny-*`` preset) to ``--batch`` requests at ``--context`` tokens, with the kernels ``impl="auto"`` picks on
the GPU, and counts one decode step: one iteration of ``runner.DECODE_STEPS``'s ``while_loop`` (``--program
step``: ``runner.STEP``, the whole program).

- ``kernels_per_step``: the fusions and custom calls (attention, KV write, Triton GEMMs, sorts) a step
  where no block moves launches. Where the step branches (``lax.cond``), the count follows each
  conditional's branch of the fewest kernels, but for the one holding at least half of the most a step can
  run: the model's forward pass, which every decode step runs. ``kernels_most`` and ``conditionals_most``
  follow every largest branch instead (a step that moves blocks and samples; an upper bound).
- ``copies_per_step``: HLO copies on that path (buffer copies; a profiler trace lists them as memcpys).
- ``conditionals_per_step`` and ``loops_per_step``: the ``conditional`` and ``while`` ops on that path (each
  loop counted once). Unless XLA runs them inside a CUDA graph, each reads its predicate back to the host
  and waits for it before it launches the next kernel.
- ``top``: the kernels by fusion kind and the JAX operation they come from; ``--layer``: one layer's
  kernels in order (``layer``), from one attention call to the next.
- ``command_buffers`` and ``control_outside_graphs`` (the whole program, from XLA's thunk sequence): the
  CUDA graphs XLA records, and the loops and conditionals left outside them, which read their predicates
  back to the host (``XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`` puts them inside).

``--module PATH`` counts a module dumped before (``XLA_FLAGS=--xla_dump_to=PATH``): ``gpu_session.sh`` dumps its
decode profile's on the GPU, to set this count against the trace's.

Set up once (no GPU needed): ``python -m venv /tmp/gpu-venv && /tmp/gpu-venv/bin/pip install -e .
'jax[cuda12]==<jax version>'``. Run: ``/tmp/gpu-venv/bin/python benchmarks/gpu_hlo.py --config gemma-3-270m
--batch 1 --context 1024 [--target h200] [--json]``. ``decode_profile.py`` measures the same step on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

# The CUDA plugin refuses to start where it finds no GPU unless told to skip its version check.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# What XLA needs to know of the target: the sm_90 limits and the H200's / H100 SXM's SM count, memory,
# bandwidth and clock (NVIDIA's data sheets). Fusion and GEMM decisions read these.
SM90 = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_core": 228 * 1024, "shared_memory_per_block_optin": 227 * 1024,
        "threads_per_core_limit": 2048, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "thread_dim_limit_x": 1024,
        "thread_dim_limit_y": 1024, "thread_dim_limit_z": 64, "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536, "l2_cache_size": 50 * 2**20, "clock_rate_ghz": 1.98}
TARGETS = {
    "h200": {"name": "NVIDIA H200", "core_count": 132, "memory_bandwidth": 4_800_000_000_000,
             "device_memory_size": 141 * 10**9},
    "h100": {"name": "NVIDIA H100 80GB HBM3", "core_count": 132, "memory_bandwidth": 3_350_000_000_000,
             "device_memory_size": 80 * 10**9},
}
# The lent GPU machine's CUDA 13 (toolkit and driver). Unset, XLA reads version 0 and, as for a driver
# older than 12.3, records no custom call (the attention kernels), loop or conditional in a CUDA graph.
CUDA_VERSION = (13, 0, 0)
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
               "partition-id", "replica-id"}
CONTROL = {"while", "conditional", "call"}


def target_config(target: str) -> str:
    """``stream_executor.GpuTargetConfigProto`` in text form for ``target`` (a key of ``TARGETS``)."""
    info = {**SM90, **TARGETS[target]}
    info["driver_version"] = ".".join(map(str, CUDA_VERSION))
    fields = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in info.items())
    major, minor, patch = CUDA_VERSION
    return (f"gpu_device_info {{\n{fields}  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
            f'platform_name: "CUDA"\nruntime_version {{ major: {major} minor: {minor} patch: {patch} }}\n'
            f'device_description_str: {json.dumps(info["name"])}\n')


# --- reading an optimised module -------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_NAME = re.compile(r"^(?:ROOT )?%?[\w.\-]+ = ")


def opcode(line: str) -> str | None:
    """The op of an instruction line (``%x = TYPE op(...)``; a tuple TYPE is parenthesised), else None."""
    head = _NAME.match(line)
    if not head:
        return None
    i, depth = head.end(), 0
    while i < len(line):  # skip the type: a tuple's parentheses nest
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        i += 1
        if depth == 0 and line[i - 1] in " )":
            break
    op = re.match(r"\s*([a-z][\w\-]*)\(", line[i:])
    return op.group(1) if op else None


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """(computation name -> its instruction lines, the entry computation's name) of an HLO module's text."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and line.strip():
            comps[current].append(line.strip())
    if entry is None:
        raise ValueError("no ENTRY computation in the module")
    return comps, entry


def _label(line: str, op: str) -> str:
    """A kernel's name in the summary: a fusion's kind and the JAX operation it comes from, a custom call's
    target."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line)
        return f"custom-call {target.group(1) if target else '?'}"
    if op != "fusion":
        return op
    kind = re.search(r"kind=(\w+)", line)
    source = re.search(r'op_name="([^"]+)"', line) or re.search(r'"kind":"([^"]+)"', line)  # else the emitter
    return f"{kind.group(1) if kind else 'fusion'} {source.group(1).rsplit('/', 1)[-1] if source else '?'}"


def _callees(line: str, op: str) -> list[list[str]]:
    """The computations a control-flow op runs, as alternatives: a conditional's branches (one runs), a
    loop's condition and body or a call's callee (all run)."""
    if op == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = (listed.group(1).split(",") if listed else
                 re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line).groups())
        return [[n.strip().lstrip("%")] for n in names]
    found = [re.search(rf"{key}=%?([\w.\-]+)", line) for key in ("condition", "body", "to_apply")]
    return [[m.group(1) for m in found if m]]


def path_count(comps: dict[str, list[str]], name: str, floor: int | None = None) -> collections.Counter:
    """Kernels, copies, conditionals and loops of running computation ``name`` once (``"#kernels"``,
    ``"#copies"``, ``"#conditionals"``, ``"#loops"``, and one entry per kernel label). At a conditional
    it follows the branch of the most kernels; with ``floor``, the branch of the fewest unless another
    holds at least ``floor`` kernels (the model's forward pass, which every decode step runs)."""
    total = collections.Counter()
    for line in comps[name]:
        op = opcode(line)
        if op is None or op in NOT_KERNELS:
            continue
        if op in CONTROL:
            runs = [sum((path_count(comps, c, floor) for c in alternative), collections.Counter())
                    for alternative in _callees(line, op)]
            most = max(runs, key=lambda r: r["#kernels"])
            fewest = min(runs, key=lambda r: r["#kernels"])
            total += most if floor is None or most["#kernels"] >= floor else fewest
            total["#conditionals" if op == "conditional" else "#loops"] += op != "call"
        elif op == "copy":
            total["#copies"] += 1
        else:
            total["#kernels"] += 1
            total[_label(line, op)] += 1
    return total


def decode_step_counts(hlo: str, program: str) -> tuple[collections.Counter, collections.Counter]:
    """``path_count`` of one decode step of ``program``'s optimised module (the body and condition of the
    entry's largest ``while`` for ``decode_steps``, the whole entry for ``step``): (a step where no block
    moves, the usual one: the fewest kernels but the forward pass; the most kernels a step can run)."""
    comps, entry = computations(hlo)
    parts = [[entry]]
    if program == "decode_steps":
        parts = [_callees(line, "while")[0] for line in comps[entry] if opcode(line) == "while"]
        if not parts:
            raise ValueError("the decode_steps module has no while loop in its entry computation")

    def count(names, floor=None):
        return sum((path_count(comps, c, floor) for c in names), collections.Counter())
    most = max((count(names) for names in parts), key=lambda r: r["#kernels"])
    usual = max((count(names, most["#kernels"] // 2) for names in parts), key=lambda r: r["#kernels"])
    return usual, most


def summary(usual: collections.Counter, most: collections.Counter, top: int) -> dict:
    """The row's counted fields of ``decode_step_counts``."""
    kernels = [(k, n) for k, n in usual.most_common() if not k.startswith("#")]
    return {"kernels_per_step": usual["#kernels"], "copies_per_step": usual["#copies"],
            "conditionals_per_step": usual["#conditionals"], "loops_per_step": usual["#loops"],
            "kernels_most": most["#kernels"], "conditionals_most": most["#conditionals"],
            "top": [{"kernel": k, "per_step": n} for k, n in kernels[:top]]}


def layer_kernels(hlo: str, marker: str = "mosaic_gpu") -> list[str]:
    """One layer's kernels (labels, copies as ``copy``) in program order: in the computation that calls
    the attention kernel most often (a custom call whose target holds ``marker``), from its first call to
    the next (or to the end)."""
    comps, _ = computations(hlo)

    def calls(line):
        return opcode(line) == "custom-call" and marker in _label(line, "custom-call")
    name = max(comps, key=lambda c: sum(map(calls, comps[c])))
    lines = comps[name]
    at = [i for i, line in enumerate(lines) if calls(line)]
    if not at:
        raise ValueError(f"no custom call to {marker!r} in the module")
    layer = []
    for line in lines[at[0]:at[1] if len(at) > 1 else len(lines)]:
        op = opcode(line)
        if op is not None and op not in NOT_KERNELS and op not in CONTROL:
            layer.append(_label(line, op) if op != "copy" else "copy")
    return layer


_THUNK = re.compile(r"^( *)\d+: (k\w+)")


def graph_counts(thunks: str) -> dict:
    """From XLA's thunk sequence (``*thunk_sequence_after_thunk_passes.txt``, nested by indentation): the
    command buffers (CUDA graphs: their kernels launch as one), and the loops and conditionals in none of
    them. Each of those reads its predicate back to the host whenever it runs; inside a command buffer the
    device decides (``--xla_gpu_enable_command_buffer`` with ``WHILE`` and ``CONDITIONAL``)."""
    stack, graphs, outside = [], 0, 0  # stack: (indent, kind) of the enclosing thunks
    for line in thunks.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        graphs += kind == "kCommandBuffer"
        outside += kind in ("kWhile", "kConditional") and all(k != "kCommandBuffer" for _, k in stack)
        stack.append((indent, kind))
    return {"command_buffers": graphs, "control_outside_graphs": outside}


# --- compiling for the target ----------------------------------------------------------------------------

def _largest_dump(path: str, program: str, suffix: str) -> str | None:
    """The largest file of ``program`` in XLA's dump folder ``path`` that ends with ``suffix`` (several where
    several were compiled), read; None when there is none."""
    found = glob.glob(f"{path}/*jit_{program}.*{suffix}")
    return Path(max(found, key=lambda f: Path(f).stat().st_size)).read_text() if found else None


def dumped_module(path: str, program: str) -> str:
    """The optimised module of ``program`` (``decode_steps`` or ``step``) in XLA's dump folder ``path`` (the
    largest, where several were compiled), or the file ``path`` itself."""
    if Path(path).is_file():
        return Path(path).read_text()
    hlo = _largest_dump(path, program, "after_optimizations.txt")
    if hlo is None:
        raise SystemExit(f"no optimised module of jit_{program} in {path}")
    return hlo


def dumped_thunks(path: str, program: str) -> str | None:
    """XLA's thunk sequence of ``program`` in the dump folder ``path`` (the largest), if it wrote one."""
    return _largest_dump(path, program, "thunk_sequence_after_thunk_passes.txt")


def optimised_module(config: str, batch: int, context: int, program: str, target: str,
                     dump: str) -> tuple[str, str]:
    """(the optimised HLO text of ``program`` for ``config`` at ``batch`` x ``context``, the GPU it was
    compiled for): the machine's GPU or, without one, ``target``. XLA dumps it into ``dump`` (set in
    ``XLA_FLAGS`` before the backend starts)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding, use_abstract_mesh

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_projection as gp

    from hkv_jax.engine.runner import DECODE_STEPS, STEP
    from hkv_jax.engine.step_messages import SAMPLING

    try:
        device = jax.devices("cuda")[0]
    except RuntimeError:  # no GPU here: a compile-only device described by the target config
        try:
            device = topologies.get_topology_desc("", "cuda", target_config=target_config(target),
                                                  topology="1x1x1").devices[0]
        except NotImplementedError as e:
            raise SystemExit("this jaxlib cannot compile for CUDA: install the CUDA plugin matching jax, "
                             f"pip install 'jax[cuda12]=={jax.__version__}' (no GPU needed)") from e
    static, params, state, plan_, *_ = gp.abstract_engine(config, batch, context)
    on = SingleDeviceSharding(device)
    params, state, plan_ = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on),
                                        (params, state, plan_))
    with use_abstract_mesh(gp.DEVICES["h200"][0]):  # impl="auto" picks the GPU's kernels
        if program == "step":
            traced = STEP.trace(static, params, state, plan_)
        else:
            rows = plan_.data.shape[0] // (2 + len(SAMPLING))
            traced = DECODE_STEPS.trace(static, gp.DECODE_CALL_STEPS, params, state, plan_,
                                        jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=on),
                                        jax.ShapeDtypeStruct((8,), jnp.int32, sharding=on))
    try:
        traced.lower(lowering_platforms=("cuda",)).compile()
    except Exception as e:  # noqa: BLE001 - a compile-only device cannot load the program; the dump is there
        print(f"# compile stopped after optimisation ({type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
    return dumped_module(dump, program), device.device_kind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gemma-3-270m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--program", choices=("decode_steps", "step"), default="decode_steps")
    p.add_argument("--target", choices=sorted(TARGETS), default="h200",
                   help="the GPU to compile for where the machine has none")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--keep", help="dump XLA's modules into this folder and keep them")
    p.add_argument("--module", help="count this optimised module (a file, or XLA's dump folder of a run "
                   "made with XLA_FLAGS=--xla_dump_to=...) instead of compiling")
    p.add_argument("--layer", action="store_true", help="also list one layer's kernels in order (``layer``)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if min(a.batch, a.context) < 1:
        p.error("--batch and --context must be positive")
    if a.module:
        hlo, compiled_for = dumped_module(a.module, a.program), f"module {a.module}"
        thunks = dumped_thunks(a.module, a.program) if Path(a.module).is_dir() else None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            dump = a.keep or tmp
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
            hlo, compiled_for = optimised_module(a.config, a.batch, a.context, a.program, a.target, dump)
            thunks = dumped_thunks(dump, a.program)
    import jax

    graphs = graph_counts(thunks) if thunks else {"command_buffers": None, "control_outside_graphs": None}
    row = {"bench": "hlo_kernels", "config": a.config, "batch": a.batch, "context": a.context,
           "program": a.program, "compiled_for": compiled_for, "jax": jax.__version__,
           **summary(*decode_step_counts(hlo, a.program), a.top), **graphs}
    print(f"{a.config} B={a.batch} ctx={a.context} ({a.program}, {compiled_for}, jax {jax.__version__}): "
          f"{row['kernels_per_step']} kernels, {row['copies_per_step']} copies, {row['conditionals_per_step']} "
          f"conditionals, {row['loops_per_step']} loops a step where no block moves; at most "
          f"{row['kernels_most']} kernels and {row['conditionals_most']} conditionals; "
          f"{row['command_buffers']} command buffers, {row['control_outside_graphs']} loops and conditionals "
          "outside them", file=sys.stderr)
    for k in row["top"]:
        print(f"  {k['per_step']:5d}  {k['kernel']}", file=sys.stderr)
    if a.layer:
        row["layer"] = layer_kernels(hlo)
        print(f"one layer, {len(row['layer'])} kernels: " + ", ".join(row["layer"]), file=sys.stderr)
    if a.json:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
