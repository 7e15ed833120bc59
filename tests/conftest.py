"""Shared test helpers: the conformance traces (in the repo), compile settings, small models, oracles."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The suite's time goes mostly to XLA compiles of small programs: compile them at LLVM -O0 (results are
# the same; the programs run a little slower). Set before jax is imported; subprocesses inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The CLI's persistent compilation cache stays off: tests write nothing under the home directory.
os.environ.setdefault("HKV_COMPILATION_CACHE", "")


def _run_compilation_cache() -> None:
    """With ``HKV_TEST_COMPILATION_CACHE=1``: one persistent compilation cache for the whole run. The
    controller makes an empty directory, and the workers and every subprocess inherit it
    (``JAX_COMPILATION_CACHE_DIR``), so a program that a test compiled is loaded, not compiled again, by a
    later module (after ``jax.clear_caches``), by the other worker and by the CLI, example and benchmark
    subprocesses. Every program goes in (no minimum compile time); the report counts hits, misses and the
    seconds they saved. Off by default: a clean run hit on a quarter of its programs, but those are the
    small ones (each engine's step programs are its own), and it saved no wall time
    (``docs/testing.md``)."""
    import atexit
    import shutil
    import tempfile

    if os.environ.get("HKV_TEST_COMPILATION_CACHE") != "1" or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # off, or a worker (the controller's directory is inherited), or the user's own cache
    path = tempfile.mkdtemp(prefix="hkv_jax_test_xla_")
    atexit.register(shutil.rmtree, path, True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


_run_compilation_cache()


def _preload_no_jit_eh_frames() -> None:
    """Preload ``native/no_jit_eh_frames.c`` (why: its comment) into the xdist workers and every subprocess.

    Three clean-clone runs lost a worker to that segfault, each after some hundred compiles. LD_PRELOAD acts
    on processes started from here on: the workers (this runs in the controller before it starts them) and
    the tests' subprocesses, not this process (``-n 0`` runs without it)."""
    import hashlib
    import shutil
    import subprocess
    import sys
    import tempfile

    preload = os.environ.get("LD_PRELOAD", "")
    if "hkv_no_jit_eh_frames" in preload or not sys.platform.startswith("linux"):
        return
    src = Path(__file__).with_name("native") / "no_jit_eh_frames.c"
    so = Path(tempfile.gettempdir()) / f"hkv_no_jit_eh_frames_{hashlib.sha1(src.read_bytes()).hexdigest()[:12]}.so"
    if not so.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            print("conftest: no C compiler; XLA's JIT unwind tables stay registered (see tests/native/)",
                  file=sys.stderr)
            return
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src)], check=True)
        tmp.replace(so)
    os.environ["LD_PRELOAD"] = f"{so}:{preload}" if preload else str(so)


_preload_no_jit_eh_frames()

# The longest tests (or xdist groups), longest first (a clean-clone run on 2 cores, AMD EPYC: 560, 300, about
# 350 s for the serve group, 140, 130, 120 and 120 s). Sent to the workers first (``--no-loadscope-reorder``
# keeps this order), so that the suite does not end with one worker on a long test while the other idles.
LONGEST_FIRST = (
    "test_gemma3.py::test_engine_equals_transformers",
    "test_sharding.py::test_sharded_engine",
    "test_examples.py::",  # the serve group: test_examples.py, then test_serve.py
    "test_pymodel_properties.py::",
    "test_engine.py::test_engine_generates",
    "test_engine_paths.py::",
    "test_host_tier.py::test_hits",
    "test_cli.py::test_demo_serves",
    "test_benchmarks.py::test_engine_benchmark",
    "test_benchmarks.py::test_gpu_session",
)


def pytest_collection_modifyitems(config, items):
    """Put ``LONGEST_FIRST`` ahead of the rest, in its order (the rest keep theirs). A test marked with two
    xdist groups stops the run: xdist runs it in a third group (the names joined), where it shares compiled
    programs with neither."""
    twice = [item.nodeid for item in items if len(list(item.iter_markers("xdist_group"))) > 1]
    if twice:
        raise pytest.UsageError(f"tests marked with more than one xdist_group: {twice}")

    def rank(item):
        return next((i for i, key in enumerate(LONGEST_FIRST) if key in item.nodeid), len(LONGEST_FIRST))

    items.sort(key=rank)

# These come after the environment settings above, which must precede jax's import.
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hkv_jax.engine.factory import ServeConfig, build_engine  # noqa: E402
from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# vLLM 0.33's answers on the conformance traces (docs/trace-format.md), and the tool that compares results.
TRACE_DIR = ROOT / "tests" / "data" / "traces"
TRACES = sorted(p for p in TRACE_DIR.glob("*.json") if not p.name.endswith(".expected.json"))
COMPARE = ROOT / "tools" / "compare_replay.py"


def _program_sharing(item) -> str:
    """Which tests may share compiled programs: those of one xdist group (one worker runs them in a row),
    else those of one module."""
    group = item.get_closest_marker("xdist_group")
    return f"group {group.args[0]}" if group else item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Drop every compiled program when the next test shares none with this one. A worker that keeps them
    all runs out of memory mappings late in the suite (XLA:CPU maps each program's code;
    ``vm.max_map_count`` is 65530): mmap then fails anywhere ("Failed to materialize symbols",
    ``MemoryError``, a shared object that cannot map)."""
    if nextitem is None or _program_sharing(item) != _program_sharing(nextitem):
        import jax

        jax.clear_caches()


# The tests' ``hkv serve``: tiny-gptoss on byte tokens, in this process. test_serve.py, the serve soak
# (test_benchmarks.py) and the client snippets and examples (test_examples.py) run in one xdist group
# ("serve") against servers of these sizes, so their programs compile once.
SERVE_CFG = ServeConfig(model="tiny-gptoss", engine=dict(num_blocks=64, max_model_len=96, max_requests=4,
                                                     token_budget=32))
SERVE_OPTIONS = {"max_top_logprobs": 2, "max_logit_bias": 2}


def start_test_server(api_key: str | None = None):
    """A started ``CompletionServer`` of ``SERVE_CFG`` on a free loopback port; its ``url`` set."""
    from hkv_jax.models.tokenizer import ByteCodec
    from hkv_jax.serve import CompletionServer

    engine, _ = build_engine(SERVE_CFG, **SERVE_OPTIONS)
    served = CompletionServer(engine, ByteCodec(), SERVE_CFG.model, api_key=api_key)
    host, port = served.start("127.0.0.1", 0)
    served.url = f"http://{host}:{port}"
    return served


# The compile report: seconds each test spent tracing, lowering and compiling with XLA in its own process
# (jax.monitoring's compile events), sent to the controller as user properties and summed per module at the
# end. Subprocesses' compiles count as run time.
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/jaxpr_trace_duration")
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"  # a hit's compile time less its load time
_COUNTS = ("seconds", "programs", "hits", "misses", "saved")
_compile_now = dict.fromkeys(_COUNTS, 0)


def _on_compile_event(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_now["seconds"] += duration
        _compile_now["programs"] += event == _COMPILE_EVENTS[0]
    elif event == _SAVED_EVENT:
        _compile_now["saved"] += duration


def _on_cache_event(event: str, **_) -> None:
    if event in _CACHE_EVENTS:
        _compile_now[_CACHE_EVENTS[event]] += 1


_MODULES: dict = {}  # module -> [tests, seconds, then _COUNTS]


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
    jax.monitoring.register_event_listener(_on_cache_event)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.hkv_compile_start = dict(_compile_now)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and hasattr(item, "hkv_compile_start"):
        start = item.hkv_compile_start
        outcome.get_result().user_properties.append(
            ("compile", tuple(_compile_now[k] - start[k] for k in _COUNTS)))


def pytest_runtest_logreport(report):
    """Sum each test's time and compiles per module (in the controller, or in the one process of ``-n 0``)."""
    row = _MODULES.setdefault(report.nodeid.split("::")[0], [0, 0.0] + [0] * len(_COUNTS))
    row[0] += report.when == "call"
    row[1] += report.duration
    for name, value in report.user_properties:
        if name == "compile" and report.when == "teardown":
            for i, v in enumerate(value):
                row[2 + i] += v


def pytest_terminal_summary(terminalreporter):
    """Per module: tests, wall seconds (setup, call and teardown), compile seconds, programs compiled, and
    the run's persistent compilation cache's hits, misses and seconds saved (what the hits took to compile
    less what loading them took)."""
    if not _MODULES or hasattr(terminalreporter.config, "workerinput"):
        return
    rows = sorted(_MODULES.items(), key=lambda kv: -kv[1][1])
    cache = bool(os.environ.get("JAX_COMPILATION_CACHE_DIR"))  # the run's cache columns, when it has one
    terminalreporter.write_sep("=", "time and XLA compiles per module (in-process compiles only)")
    terminalreporter.write_line(f"{'module':40s} {'tests':>5s} {'seconds':>8s} {'compile s':>9s} {'programs':>8s}"
                                + (f" {'hits':>6s} {'misses':>6s} {'saved s':>7s}" if cache else ""))
    for module, row in rows + [("total", [sum(r[i] for _, r in rows) for i in range(len(rows[0][1]))])]:
        tests, seconds, compile_s, programs, hits, misses, saved = row
        terminalreporter.write_line(f"{module:40s} {tests:5d} {seconds:8.1f} {compile_s:9.1f} {programs:8d}"
                                    + (f" {hits:6d} {misses:6d} {saved:7.1f}" if cache else ""))


def load_trace(path: Path) -> tuple[dict, dict]:
    """(trace, expected result) of a conformance trace."""
    return json.loads(path.read_text()), json.loads(path.with_suffix(".expected.json").read_text())


def require_traces() -> None:
    """Fail loudly (not skip) when the conformance traces are missing: they live in the repo."""
    if not TRACES:
        pytest.fail(f"no conformance traces found under {TRACE_DIR}")


# Small hybrid models (block size 4 in the tests) for the allocator's property and equivalence tests.
HYBRID_MODELS = {
    "full": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8)],  # one group: the degenerate case
    "sw+full": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6)],
    "three": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6),
              ChunkedLocalSpec(name="c", num_kv_heads=1, head_size=8, attention_chunk_size=8)],
    "mamba": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              MambaSpec(name="m", shapes=[[2, 4]], dtypes=["float32"])],
}

# Groups of different block sizes, planned with block size 4 under ``vllm`` (a layer whose page divides the
# largest gets proportionally more tokens per block): two sizes (full 8, sliding 4 with a one-block window,
# cached only before each 8-token boundary) and three (sliding 4 with a two-block window, full 8, full 16:
# hits on 16-token boundaries).
MIXED_MODELS = {
    "mixed-2": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                SlidingWindowSpec(name="s", num_kv_heads=1, head_size=16, sliding_window=4)],
    "mixed-3": [SlidingWindowSpec(name="s", num_kv_heads=1, head_size=32, sliding_window=6),
                FullAttentionSpec(name="f", num_kv_heads=1, head_size=16),
                FullAttentionSpec(name="g", num_kv_heads=1, head_size=8)],
}


def _lookups(cache, keys, full):
    """Block each key is cached under, per group (``i32[G, K]``), -1 where ``full`` is False."""
    import jax
    import jax.numpy as jnp

    from hkv_jax.allocator import prefix_cache

    groups = jnp.arange(cache.num_groups, dtype=jnp.int32)
    found = jax.vmap(lambda g: prefix_cache.lookup(cache, keys, jnp.full(keys.shape[0], g)))(groups)
    return jnp.where(full[None, :], found, -1)


_LOOKUPS = []  # the jitted ``_lookups``, made on first use (jax is imported late: see the top)


def semantic(st, layout):
    """What two allocator states must share to be equal in behaviour: queue order, refs, tables,
    computed tokens, which blocks are cached and where lookups of every request's full blocks land
    (not the table slots)."""
    import jax

    from hkv_jax.allocator.free_queue import queue_order

    if not _LOOKUPS:
        _LOOKUPS.append(jax.jit(_lookups))
    # The hashes of every request's full blocks (past them a slot's hashes are unspecified).
    full = np.arange(st.hashes.shape[1])[None, :] < np.asarray(st.num_tokens)[:, None] // layout.hash_block_size
    out = {
        "queue": queue_order(st.block_pool.free_queue),
        "free": int(st.block_pool.free_queue.num_free),
        "ref_count": np.asarray(st.block_pool.free_queue.ref_count).tolist(),
        "status": np.asarray(st.status).tolist(),
    }
    for f in ("tables", "table_len", "num_computed", "num_cached", "retired", "last_state"):
        out[f] = np.asarray(getattr(st, f)).tolist()
    out["cached"] = (np.asarray(st.block_pool.prefix_cache.block_slot) >= 0).tolist()
    out["lookups"] = np.asarray(
        _LOOKUPS[0](st.block_pool.prefix_cache, st.hashes.reshape(-1, 4), full.reshape(-1))
    ).tolist()
    return out


# The oracle of the attention kernels: plain attention over an unpaged sequence.
def dense_attention(q, k, v, params, sinks) -> np.ndarray:
    """Plain causal attention in numpy of one unpaged sequence (the oracle).

    ``q: [Lq, Hq, D]`` are the last ``Lq`` positions of ``k, v: [L, Hkv, D]``.
    """
    lq, length, hq, d = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    k, v = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    out = np.zeros((lq, hq, d))
    scale = params.sm_scale or d ** -0.5
    for i in range(lq):
        pos = length - lq + i
        lo = first_visible(pos, params)
        s = np.einsum("hd,khd->hk", q[i], k[lo:pos + 1]) * scale
        if params.soft_cap:
            s = params.soft_cap * np.tanh(s / params.soft_cap)
        if sinks is not None:
            s = np.concatenate([s, sinks[:, None]], axis=1)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hk,khd->hd", p[:, :pos + 1 - lo], v[lo:pos + 1])
    return out.astype(np.float32)


def first_visible(pos: int, params) -> int:
    """First key position a query at ``pos`` sees."""
    lo = 0
    if params.sliding_window:
        lo = max(lo, pos - params.sliding_window + 1)
    if params.chunk_size:
        lo = max(lo, pos // params.chunk_size * params.chunk_size)
    return lo
