"""Allocator step time: B requests with 2048-token random prompts, one prefill, then 32 decode steps.

The workload of ``shared/tools/vllm_oracle/replay.py --bench`` (vLLM 0.33's KVCacheManager), run through
hkv-jax's jitted allocator: block size 16, prefix caching on, ``vllm`` planner policy (or ``--policy``), pool sized
by the oracle's formula (under another policy: the same bytes). Prefill = lookup + allocate of the whole prompt
for every request (one ``prefill_batch`` program; it reports whether its vectorised path ran); a decode step =
every request allocates one more token (one ``decode_step`` program; it reports which path ran: token count
only, vectorised, or the sequential fallback).
Both programs are compiled without their sequential fallback (``fallback=False``: a smaller program, a
cheaper call); where one could not vectorise, ``schedule_batch`` runs as a second program within the timing.
A decode step first runs ``idle_decode`` (a read-only check of whether the step only counts the token, the
usual step, with the state it would leave); when a block moves the whole ``decode_step`` runs next, within the
timing.
Times are wall clock after compilation, with ``block_until_ready``; decode is the median of the 32 steps,
prefill the median of ``--repeats`` fresh prefills after an untimed one. Run:
``python benchmarks/allocator_step.py [--models full32,gemma3,gptoss,gemma4] [--batch 64,256,1024]
[--policy vllm|min-waste] [--malloc-hugepages] [--json]``. The models are ``bench_models.py``'s; gemma4 has
groups of 16 and 32 tokens per block under ``vllm`` (hits and caching on 32-token boundaries), one block
size under ``min-waste`` (two full-attention layers share a page slot).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np
from bench_models import MODELS

from hkv_jax.allocator import ops
from hkv_jax.allocator.decode import DecodePath
from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.planner import POLICIES, cdiv, plan
from hkv_jax.spec import layers_from_trace

PROMPT, DECODE, BS = 2048, 32, 16
COMPARE_STEPS = 96  # decode steps per protocol with --compare-one-program
HUGEPAGES = "glibc.malloc.hugetlb=1"


def model_layers(name: str):
    return layers_from_trace({"layer_pattern": MODELS[name]})


def run_one(name: str, batch: int, repeats: int, num_blocks: int | None = None, compare: bool = False,
            policy: str = "vllm") -> dict:
    """One model and batch; ``compare``: also time the whole ``decode_step`` as one program per step,
    alternating with the idle-first protocol in rounds of 16 steps (``COMPARE_STEPS`` steps each)."""
    decode_steps = 2 * COMPARE_STEPS if compare else DECODE
    layers = model_layers(name)
    vllm = plan(layers, block_size=BS, policy="vllm", num_blocks=2)
    per_req = cdiv(PROMPT + decode_steps + BS, BS)
    nb = num_blocks or batch * per_req * (len(vllm.groups) + 1) + 64  # the oracle's pool size
    if policy != "vllm" and not num_blocks:  # the same bytes
        nb = nb * vllm.bytes_per_block // plan(layers, block_size=BS, policy=policy, num_blocks=2).bytes_per_block
    cfg = plan(layers, block_size=BS, policy=policy, num_blocks=nb)
    groups = len(cfg.groups)
    layout = Layout.from_config(cfg, max_model_len=PROMPT + decode_steps + 2 * BS, max_requests=batch)
    rng = np.random.default_rng(0)
    toks = np.zeros((batch, layout.max_model_len), np.int32)
    toks[:, :PROMPT] = rng.integers(1, 32000, size=(batch, PROMPT))
    slots = jnp.arange(batch, dtype=jnp.int32)
    add = jax.jit(ops.add_batch, static_argnums=0)
    # The batched programs without their sequential fallback (a smaller program: a cheaper call); when
    # one reports that it applied nothing, the fallback runs as a second program, inside the timing.
    sched = jax.jit(functools.partial(ops.prefill_batch, fallback=False), static_argnums=0, donate_argnums=1)
    decode = jax.jit(functools.partial(ops.decode_step, fallback=False), static_argnums=0, donate_argnums=1)
    append = jax.jit(ops.append_batch, static_argnums=0, donate_argnums=1)
    sequential = jax.jit(ops.schedule_batch, static_argnums=0, donate_argnums=1)

    def fresh():
        st = add(layout, init_state(layout), slots, jnp.asarray(toks), jnp.full(batch, PROMPT, jnp.int32),
                 jnp.zeros(batch, jnp.uint32))
        return jax.block_until_ready(st)

    # Compile everything first (the fallback too: it must not be compiled inside a timed step).
    all_tokens, one_token, all_ok = jnp.full(batch, -1, jnp.int32), jnp.ones(batch, jnp.int32), jnp.ones(batch, bool)
    jax.block_until_ready(sched(layout, fresh(), slots, all_tokens))
    jax.block_until_ready(sequential(layout, fresh(), slots, one_token))

    def prefill_step(st):
        st, ok, _, _, fast = sched(layout, st, slots, all_tokens)
        if not bool(fast):
            st, ok, _, _ = sequential(layout, st, slots, all_tokens)
        return jax.block_until_ready((st, ok)), bool(fast)

    def decode_step(st, idle_first=True):
        idle = False
        if idle_first:
            after, idle = ops.idle_decode(layout, st, slots)  # jitted, read-only
            idle = bool(idle)
        if idle:  # only the counters are new: every other array is the previous (ready) state's
            jax.block_until_ready(after.counts)
            return (after, all_ok), 0
        st, ok, path = decode(layout, st, slots)  # a block moves: the whole step
        if int(path) == DecodePath.FALLBACK:
            st, ok, _, _ = sequential(layout, st, slots, one_token)
        return jax.block_until_ready((st, ok)), int(path)

    prefill_step(fresh())  # warm-up: the first calls after compiling also grow malloc's heap (page faults)
    prefill, prefill_vectorised = [], 0
    for _ in range(repeats):
        st = fresh()
        t = time.perf_counter()
        (st, ok), fast = prefill_step(st)
        prefill.append(time.perf_counter() - t)
        prefill_vectorised += int(fast)
        if not bool(ok.all()):
            raise RuntimeError("pool too small for the prefill")
    st = jax.block_until_ready(append(layout, st, slots, jnp.asarray(rng.integers(1, 32000, batch), jnp.int32)))
    jax.block_until_ready(decode(layout, jax.tree.map(jnp.copy, st), slots))  # compile the decode programs
    jax.block_until_ready(ops.idle_decode(layout, st, slots))
    steps, paths, one_program = [], [0] * len(DecodePath), []
    for i in range(decode_steps):
        idle_first = not compare or (i // 16) % 2 == 0
        t = time.perf_counter()
        (st, ok), path = decode_step(st, idle_first)
        (steps if idle_first else one_program).append(time.perf_counter() - t)
        paths[path] += idle_first
        if not bool(ok.all()):
            raise RuntimeError("pool too small for decode")
        # Appending the sampled token (and hashing a block it fills) is not part of the step, as in vLLM's
        # measurement; wait for it, or its work would be timed with the next step.
        st = jax.block_until_ready(append(layout, st, slots, jnp.asarray(rng.integers(1, 32000, batch), jnp.int32)))
    row = {"model": name, "policy": policy, "batch": batch, "num_blocks": nb, "groups": groups,
           "block_sizes": sorted({g.block_size for g in cfg.groups}),
            "decode_step_us": round(statistics.median(steps) * 1e6, 1),
            "decode_step_mean_us": round(statistics.mean(steps) * 1e6, 1),
            # steps per DecodePath: token count only, vectorised, vectorised (many releases), sequential
            "decode_paths": paths,
            "prefill_us_per_request": round(statistics.median(prefill) / batch * 1e6, 1),
            "prefill_vectorised": prefill_vectorised == repeats,
            "malloc_hugepages": HUGEPAGES in os.environ.get("GLIBC_TUNABLES", "")}
    if compare:
        row.update(decode_one_program_us=round(statistics.median(one_program) * 1e6, 1),
                   decode_one_program_mean_us=round(statistics.mean(one_program) * 1e6, 1))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="full32,gemma3,gptoss")
    p.add_argument("--batch", default="64,256,1024")
    p.add_argument("--policy", default="vllm", choices=POLICIES, help="the planner's policy (default: vLLM's)")
    p.add_argument("--repeats", type=int, default=5, help="prefill repetitions (median), after one warm-up")
    p.add_argument("--num-blocks", type=int, help="pool size instead of the oracle's formula (pool-growth check)")
    p.add_argument("--compare-one-program", action="store_true",
                   help=f"also time the whole decode_step as one program per step, alternating with the idle-first "
                        f"protocol in rounds of 16 steps ({COMPARE_STEPS} steps each; pool sized for them)")
    p.add_argument("--malloc-hugepages", action="store_true",
                   help=f"rerun under GLIBC_TUNABLES={HUGEPAGES} (glibc >= 2.35): XLA's CPU temporaries come from "
                        f"transparent huge pages, not thousands of fresh 4 KiB pages per call (prefill)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.malloc_hugepages and HUGEPAGES not in os.environ.get("GLIBC_TUNABLES", ""):
        # The tunable is read at process start: run this script again with it.
        tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGEPAGES]))
        args = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *args],
                  {**os.environ, "GLIBC_TUNABLES": tunables})
    rows = []
    for m in a.models.split(","):
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        for b in map(int, a.batch.split(",")):
            print(f"... {m} B={b}", file=sys.stderr, flush=True)
            rows.append(run_one(m, b, a.repeats, a.num_blocks, a.compare_one_program, a.policy))
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"machine: {machine.describe()}, "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    print(f"policy {a.policy}")
    print(f"{'model':<8} {'B':>5} {'blocks':>9} {'decode step us':>15} {'(mean)':>9} {'paths c/v/m/s':>14} "
          f"{'prefill us/req':>15} {'vectorised':>10}")
    for r in rows:
        print(
            f"{r['model']:<8} {r['batch']:>5} {r['num_blocks']:>9} {r['decode_step_us']:>15} "
            f"{r['decode_step_mean_us']:>9} {'/'.join(map(str, r['decode_paths'])):>14} "
            f"{r['prefill_us_per_request']:>15} "
            f"{str(r['prefill_vectorised']):>10}"
        )
        if "decode_one_program_us" in r:
            print(f"{'':<8} {'':>5} {'':>9} {r['decode_one_program_us']:>15} {r['decode_one_program_mean_us']:>9}"
                  f"  <- the whole decode_step as one program per step, same run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
