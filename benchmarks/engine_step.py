"""Engine step time, split into allocator and model, on ``allocator_step.py``'s workload, old path vs new.

B requests with 2048-token random prompts (block size 16, prefix caching on, ``vllm`` policy, the vLLM
oracle's pool size: the workload of ``allocator_step.py``), served by ``hkv_jax.engine.Engine``: one step
admits and prefills them all, then ``--decode`` steps decode one token each. What is timed is what a user
runs, ``Engine.step_tokens()`` (``step()`` with the sampled tokens as arrays, not one Python pair per
token): host planning, transfers, ``prepare`` (admissions) when it runs, the step program, the report
read back and the host's bookkeeping. Its device part (the programs, from dispatch to the report) is also
reported alone.

The model is ``NoOpLM``: the workload's layer specs (so the same KV cache groups) with one-element heads,
the KV memory untouched, and zero logits one column wide (the sampled token is always 0: sampling costs
nothing), though it accepts the workload's 32,000 token ids. The step time is then the allocator's
share (plus the step's fixed plumbing: metadata, sampling, the report). ``--model-share`` also times a
tiny real model (``TinyLM`` with the workload's layer pattern: hidden 64, 1 KV head of 16, jnp reference
attention) for decode steps at the given batch sizes; its excess over the no-op step is the model's share.

``--paths new,old,multi``: ``new`` is the vectorised allocator (``Engine(vectorised=True)``), ``old`` the
per-request path (one ``schedule`` per request, ``vectorised=False``), ``multi`` the vectorised one with
``Engine(decode_steps=K)`` (``--decode-steps``: up to K decode steps per ``step()`` call, one program;
each of its steps is charged its call's time / the steps the call ran; a list such as ``8,16`` gives a
row per K), ``served`` what ``hkv serve``, ``generate`` and ``demo`` run (``GenerateConfig``'s
``decode_steps`` and ``max_call_seconds``: up to 32 steps a call, as many as fit 20 ms at the last call's
rate), measured in the same run. Decode times are medians over the decode steps (``decode_step_us``)
and means (``decode_step_mean_us``: the median leaves out the slow steps where every request takes a
block, the first decode step's window releases and the cold caches after the prefill, while the multi
path spreads them over their call's steps), prefill the median over ``--repeats`` fresh engines after a
warm-up engine that compiles every program.

Each row also has, measured in the same process just before (this machine's speed drifts by tens of
percent within minutes): ``allocator_step.py``'s figures for the same model and batch (its allocator
programs alone: ``alloc_decode_us``, ``alloc_prefill_us_per_request``) and the dispatch floor of a decode
step (``floor_us``: a program that returns the lean decode step's arguments unchanged, donated: what JAX
charges per array passed in and out, about 3 us each on this CPU; the KV memory is one array per shared
tensor, 32 for full32).

Run: ``python benchmarks/engine_step.py [--models full32,gemma3,gptoss] [--batch 64,256,1024]
[--paths new,old,multi,served] [--decode-steps 8[,16]] [--decode 32] [--repeats 3] [--model-share 64,256]
[--window-aware-eviction] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace

import allocator_step
import jax
import jax.numpy as jnp
import machine
import numpy as np
from allocator_step import BS, MODELS, PROMPT
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.generate import GENERATE_DEFAULTS
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import cdiv, plan
from hkv_jax.spec import layers_from_trace


@dataclass(frozen=True)
class NoOpConfig:
    """What the engine reads of a model's config."""

    layers: tuple
    vocab_size: int = 32000  # the token ids prompts may use


class NoOpLM(nnx.Module):
    """A model that computes nothing: zero logits, the KV memory untouched (the engine's allocator share)."""

    def __init__(self, layers):
        self.cfg = NoOpConfig(tuple(layers))

    def paged(self, tokens, positions, cache, metadata, impl="auto", sample_at=None):
        rows = tokens.shape[0] if sample_at is None else sample_at.shape[0]
        return jnp.zeros((rows, 1), jnp.float32), cache


def workload_layers(name: str, head_size: int):
    """``allocator_step.py``'s layers of model ``name`` with heads of ``head_size`` (1 KV head each)."""
    pattern = [{**layer, "num_kv_heads": 1, "head_size": head_size} for layer in MODELS[name]["pattern"]]
    return layers_from_trace({"layer_pattern": {**MODELS[name], "pattern": pattern}})


def make_engine(model, layers, batch: int, decode: int, vectorised: bool, decode_steps: int = 1,
                early: bool = False, max_call_seconds: float | None = None) -> Engine:
    groups = len(plan(layers, block_size=BS, policy="vllm", num_blocks=2).groups)
    per_req = cdiv(PROMPT + decode + BS, BS)
    nb = batch * per_req * (groups + 1) + 64  # the oracle's pool size, as allocator_step.py
    return Engine(model, num_blocks=nb, block_size=BS, max_requests=batch, max_model_len=PROMPT + decode + 2 * BS,
                  token_budget=batch * PROMPT, token_buckets=(batch, batch * PROMPT), policy="vllm",
                  impl="reference", vectorised=vectorised, decode_steps=decode_steps, window_aware_eviction=early,
                  max_call_seconds=max_call_seconds)


def timed_step(engine: Engine) -> tuple[float, float]:
    """One ``Engine.step_tokens()``: (wall seconds, seconds from its first program's dispatch to the report)."""
    before = engine.stats.device_seconds
    t = time.perf_counter()
    engine.step_tokens()
    return time.perf_counter() - t, engine.stats.device_seconds - before


def add_requests(engine: Engine, batch: int, decode: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(batch):
        engine.add_request(rng.integers(1, 32000, PROMPT).tolist(), decode + 2)


def dispatch_floor(engine: Engine, runs: int = 200) -> float:
    """Median seconds of a donated identity program over the arrays a lean decode step passes."""
    part = replace(engine.state, alloc=replace(engine.state.alloc, block_pool=None, step_cached=None))
    ident = jax.jit(lambda s: s, donate_argnums=0)
    part = jax.tree.map(jnp.copy, part)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        part = jax.block_until_ready(ident(part))
        times.append(time.perf_counter() - t)
    return statistics.median(times[runs // 5:])


def run_one(model_name: str, batch: int, path: str, decode: int, repeats: int, k: int = 1,
            early: bool = False) -> dict:
    """One row: ``path`` with up to ``k`` decode steps a call (``k`` > 1 only on the multi path; the served
    path's are ``hkv generate``'s, ``GENERATE_DEFAULTS``); ``early``: window-aware eviction."""
    layers = workload_layers(model_name, head_size=1)
    model = NoOpLM(layers)
    vectorised = path != "old"
    budget = None
    if path == "served":
        k, budget = GENERATE_DEFAULTS["decode_steps"], GENERATE_DEFAULTS["max_call_seconds"]
    # Warm-up engine: compiles prepare (this prompt size) and the step programs (the prefill, the first decode
    # step's full program, then the lean or multi-step one; the served path times one-step calls first).
    eng = make_engine(model, layers, batch, decode, vectorised, k, early, budget)
    add_requests(eng, batch, decode, seed=0)
    for _ in range(3 if budget is None else 6):
        eng.step()
    prefill, prefill_dev = [], []
    for r in range(repeats):
        eng = make_engine(model, layers, batch, decode, vectorised, k, early, budget)
        add_requests(eng, batch, decode, seed=r + 1)
        wall, dev = timed_step(eng)
        prefill.append(wall)
        prefill_dev.append(dev)
    if eng.stats.preemptions or len(eng.running) != batch:
        raise RuntimeError(f"the prefill did not run every request ({len(eng.running)} of {batch})")
    steps, steps_dev = [], []
    while len(steps) < decode:
        before = eng.stats.steps
        wall, dev = timed_step(eng)
        ran = eng.stats.steps - before  # more than 1 on the multi path
        steps += [wall / ran] * ran
        steps_dev += [dev / ran] * ran
    if eng.stats.preemptions:
        raise RuntimeError("a decode step preempted: the pool is too small")
    def us(xs):
        return round(statistics.median(xs) * 1e6, 1)

    return {
        "model": model_name,
        "batch": batch,
        "path": path,
        "decode_steps": k,
        "max_call_seconds": budget,
        "window_aware_eviction": early,
        "num_blocks": eng.layout.num_blocks,
        "groups": eng.layout.num_groups,
        "programs": eng.stats.bucket_steps,
        "decode_step_us": us(steps),
        "decode_step_mean_us": round(statistics.mean(steps) * 1e6, 1),
        "decode_device_us": us(steps_dev),
        "decode_host_us": round(us(steps) - us(steps_dev), 1),
        "prefill_us_per_request": round(us(prefill) / batch, 1),
        "prefill_device_us_per_request": round(us(prefill_dev) / batch, 1),
        "floor_us": us([dispatch_floor(eng)]),
    }


def model_share(model_name: str, batch: int, decode: int) -> dict:
    """Decode step with a tiny real model vs the no-op model, same layers and engine (new path)."""
    layers = workload_layers(model_name, head_size=16)
    cfg = TinyConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=1, num_kv_heads=1,
                     head_dim=16, layers=tuple(layers))
    out = {"model": model_name, "batch": batch}
    for label, model in (("noop", NoOpLM(layers)), ("tiny", TinyLM(cfg, nnx.Rngs(0)))):
        eng = make_engine(model, layers, batch, decode, True)
        rng = np.random.default_rng(0)
        for _ in range(batch):  # short prompts: the tiny model's CPU prefill stays affordable
            eng.add_request(rng.integers(1, 256, 4 * BS).tolist(), decode + 2)
        eng.step()
        eng.step()
        times = [timed_step(eng)[0] for _ in range(decode)]
        out[f"{label}_decode_step_us"] = round(statistics.median(times) * 1e6, 1)
    out["model_share_us"] = round(out["tiny_decode_step_us"] - out["noop_decode_step_us"], 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="full32,gemma3,gptoss")
    p.add_argument("--batch", default="64,256,1024")
    p.add_argument("--paths", default="new,old",
                   help="new (vectorised allocator), old (per request), multi (new, several decode steps a call), "
                        "served (what hkv serve runs: up to 32 steps a call, as many as fit 20 ms)")
    p.add_argument("--decode-steps", default="8", help="decode steps per call on the multi path (a list: a row each)")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3, help="prefills timed (fresh engines), after a warm-up")
    p.add_argument("--model-share", default="", help="batch sizes at which to time a tiny real model's decode step")
    p.add_argument("--window-aware-eviction", action="store_true",
                   help="the engines evict out-of-window blocks first (allocator_step.py's figures stay vLLM's order)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        ks = [int(k) for k in a.decode_steps.split(",")]
    except ValueError:
        p.error(f"--decode-steps: integers, comma-separated, not {a.decode_steps!r}")
    if min(ks) < 2:
        p.error("--decode-steps: at least 2 (1 is the new path)")
    runs = []
    for path in a.paths.split(","):
        if path not in ("new", "old", "multi", "served"):
            p.error(f"unknown path {path!r}: new, old, multi or served")
        runs += [(path, k) for k in ks] if path == "multi" else [(path, 1)]
    rows, shares = [], []
    for m in a.models.split(","):
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
        for b in map(int, a.batch.split(",")):
            print(f"... {m} B={b} allocator_step", file=sys.stderr, flush=True)
            ref = allocator_step.run_one(m, b, a.repeats)
            for path, k in runs:
                print(f"... {m} B={b} {path}" + (f" K={k}" if path == "multi" else ""), file=sys.stderr, flush=True)
                row = run_one(m, b, path, a.decode, a.repeats, k, a.window_aware_eviction)
                row.update(
                    alloc_decode_us=ref["decode_step_us"],
                    alloc_prefill_us_per_request=ref["prefill_us_per_request"],
                    decode_device_vs_alloc=round(row["decode_device_us"] / ref["decode_step_us"], 2),
                )
                rows.append(row)
                print("    " + json.dumps(row), file=sys.stderr, flush=True)  # kept if a later row fails
        for b in map(int, filter(None, a.model_share.split(","))):
            print(f"... {m} B={b} model share", file=sys.stderr, flush=True)
            shares.append(model_share(m, b, min(a.decode, 8)))
    if a.json:
        print(json.dumps({"steps": rows, "model_share": shares}, indent=1))
        return 0
    print(f"machine: {machine.describe()}")
    print(
        f"{'model':<8} {'B':>5} {'path':>7} {'decode step us':>15} {'mean':>7} {'device':>9} {'host':>9} {'floor':>7} "
        f"{'alloc':>7} {'dev/alloc':>9} {'prefill us/req':>15} {'device':>9} {'alloc':>7}"
    )
    for r in rows:
        label = r["path"] + (str(r["decode_steps"]) if r["path"] == "multi" else "")
        print(
            f"{r['model']:<8} {r['batch']:>5} {label:>7} {r['decode_step_us']:>15} {r['decode_step_mean_us']:>7} "
            f"{r['decode_device_us']:>9} "
            f"{r['decode_host_us']:>9} {r['floor_us']:>7} {r['alloc_decode_us']:>7} {r['decode_device_vs_alloc']:>9} "
            f"{r['prefill_us_per_request']:>15} {r['prefill_device_us_per_request']:>9} "
            f"{r['alloc_prefill_us_per_request']:>7}"
        )
    for s in shares:
        print(f"{s['model']:<8} {s['batch']:>5} decode step: no-op model {s['noop_decode_step_us']} us, tiny model "
              f"{s['tiny_decode_step_us']} us: model share {s['model_share_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
