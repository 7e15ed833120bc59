"""What a GPU or TPU would run, checked on this CPU: the engine's decode programs lowered for an abstract
H200 (CUDA) and an abstract TPU v5p, audited, and their bytes per step projected to a time.

For each model, batch and context it lowers the two decode programs the engine runs (``runner.STEP``: one
step, and ``runner.DECODE_STEPS``: 4 decode steps in one ``while_loop``), with the kernels ``impl="auto"``
picks on that device and a bf16 KV cache, from abstract shapes (nothing is allocated), and reports:

- ``aliased_pool``: every KV pool buffer is donated and aliased to an output of the module;
- ``pool_copies``: ops outside the attention kernels and the in-place KV write that read or write a buffer
  the size of a pool tensor (``pool_ops`` names them);
- ``bytes_per_step``: what one decode step reads and writes, in three named parts: ``weights_bytes`` (every
  parameter read once), ``kernel_bytes`` (our count of what the kernels read and write: every page a
  sequence's attention reads, whole pages, sliding-window and chunked-local groups only their window's,
  a Mamba layer's state read and written, and the new tokens' KV) and ``logits_bytes`` (the ``[B, vocab]``
  f32 logits written once and read twice by the sampler);
- ``xla_unfused_bytes``: XLA's cost analysis of the lowered module, for reference: it sees the ops before
  fusion (every elementwise op of the sampler's noise, every conversion, as a pass over memory), the
  kernels not at all, and a ``while_loop`` body once. A GPU compile fuses those chains; this machine has
  no GPU compiler to say by how much, and ``gpu_session.sh`` measures the time;
- ``ideal_bytes``: the weights plus the KV a decode step must read (each layer's attended tokens, a Mamba
  layer's state read and written);
- ``ratio = bytes_per_step / ideal_bytes``, and ``projected_ms``: ``bytes_per_step`` at 4.8 TB/s (H200) or
  2.76 TB/s (TPU v5p).

Models: Gemma 3 270M and a Gemma-3-27B-like model (the engine's Gemma 3 model, bf16 weights), and in the tiny
model family at the presets' real sizes (dense MLPs, f32 weights: it computes in f32) a Llama-3.1-8B-like,
a Jamba-like (Jamba 1.5 Mini's layer pattern with Mamba-2 mixers of Granite 4.0-H's size) and a
Gemma-4-31B-like model.

``--measure`` (on the day a GPU is lent: ``gpu_session.sh``) also serves each row on the machine's own device,
random weights, ``batch`` requests prefilled to ``context`` tokens, and reports the median decode step
(``measured_ms``, per step of a ``decode_steps`` call) against ``projected_ms``, and ``bytes_per_step`` over it
(``measured_gb_per_s``) against the HBM's peak.

Run: ``python benchmarks/gpu_projection.py [--configs gemma-3-270m,...] [--devices h200,tpu-v5p]
[--batches 1,64,256] [--contexts 1024,4096,32768] [--programs step,decode_steps] [--measure [--repeats N]]
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.cache import init_cache
from hkv_jax.engine.runner import DECODE_STEPS, STEP
from hkv_jax.engine.step import EngineState, StepStatic
from hkv_jax.engine.step_messages import SAMPLING, StepPlan
from hkv_jax.models.gemma3 import Gemma3Config, Gemma3LM
from hkv_jax.models.presets import preset_names, resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import KVCacheConfig, cdiv, plan
from hkv_jax.program_audit import audit_pool
from hkv_jax.spec import ChunkedLocalSpec, KVSharingSpec, MambaSpec, SlidingWindowSpec

DEVICES = {
    "h200": (AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                       platform="gpu")), "cuda", 4.8e12),
    "tpu-v5p": (AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5p", num_cores=None,
                                                                          platform="tpu")), "tpu", 2.76e12),
}
# Model name -> (preset, config overrides): the sizes the presets leave out (vocabulary, MLP width) as in the
# public configs; the Gemma-4-31B-like model takes Gemma 3 27B's, the Jamba-like one Mamba-2 mixers.
CONFIGS = {
    "gemma-3-270m": ("gemma-3-270m", {}),
    "gemma-3-27b-like": ("gemma-3-27b", {"vocab_size": 262208, "intermediate_size": 21504,
                                         "query_pre_attn_scalar": 168}),
    "llama-3.1-8b-like": ("llama-3.1-8b", {"vocab_size": 128256, "intermediate_size": 14336}),
    "jamba-like": ("jamba-mini-1.5", {"vocab_size": 65536, "intermediate_size": 14336, "mamba_n_heads": 128,
                                      "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1}),
    "gemma-4-31b-like": ("gemma-4-31b", {"vocab_size": 262208, "intermediate_size": 21504}),
}
BLOCK_SIZE = 16
DECODE_CALL_STEPS = 4
# Tokens past its prompt that ``decode_engine`` gives each request room for, however many calls it is asked
# for: its shapes (pool, block tables) then do not depend on the calls, so that runs of different lengths
# share their compiled programs (a warm start loads every one from the persistent cache).
DECODE_ROOM = 128
def build_model(name: str):
    """(config, abstract model) of ``name``: the Gemma 3 ones as the engine serves Gemma 3 (``Gemma3LM``, bf16
    weights), the others in the tiny model family (f32 weights: it computes in f32); a ``tiny-*`` preset as it
    is."""
    preset, overrides = CONFIGS[name] if name in CONFIGS or not name.startswith("tiny-") else (name, {})
    hf = resolve_model(preset)[1]
    if "text_config" in hf:
        hf = {**hf, "text_config": {**hf["text_config"], **overrides}}
    else:
        hf = {**hf, **overrides}
    if preset.startswith("gemma-3"):
        cfg = Gemma3Config.from_hf(hf, kv_dtype="bfloat16", param_dtype="bfloat16")
        return cfg, nnx.eval_shape(lambda: Gemma3LM(cfg, nnx.Rngs(0)))
    cfg = TinyConfig.from_hf(hf, kv_dtype="bfloat16")
    return cfg, nnx.eval_shape(lambda: TinyLM(cfg, nnx.Rngs(0)))


def blocks_per_request(config: KVCacheConfig, context: int, chunk: int = 1) -> int:
    """Blocks one request of ``context`` tokens holds across the groups during a step that computes ``chunk``
    of them (``KVCacheConfig.blocks_per_request``: a window or local chunk holds the chunk's blocks too, so
    a prompt prefills in steps of that size), with two states for each Mamba group."""
    return sum(2 * g.blocks_per_state if isinstance(g.spec, MambaSpec) else g.blocks_per_request(context, chunk)
               for g in config.groups)


def kv_traffic(config: KVCacheConfig, cfg: TinyConfig, batch: int, context: int) -> tuple[int, int]:
    """(kernel bytes: whole pages read plus the new tokens' KV written; ideal: the attended tokens' KV and
    the Mamba states read and written) of one decode step of ``batch`` requests at ``context`` tokens."""
    kernel = ideal = 0
    readers = {}  # layer name -> how many layers read its pages (KV-sharing layers read their target's)
    for spec in cfg.layers:
        target = spec.target if isinstance(spec, KVSharingSpec) else spec.name
        readers[target] = readers.get(target, 0) + 1
    for g in config.groups:
        bs, spec = g.block_size, g.spec
        page = spec.page_size_bytes(bs)
        for layer in g.layer_names:
            if isinstance(spec, MambaSpec):
                state = page * g.blocks_per_state
                kernel += 2 * batch * state
                ideal += 2 * batch * state
                continue
            if isinstance(spec, SlidingWindowSpec):
                attended = min(context, spec.sliding_window)
            elif isinstance(spec, ChunkedLocalSpec):
                attended = (context - 1) % spec.attention_chunk_size + 1
            else:
                attended = context
            start = context - attended
            pages = (context - 1) // bs - start // bs + 1
            n = readers.get(layer, 1)
            kernel += batch * (n * pages * page + page // bs)
            ideal += batch * (n * attended * page // bs + page // bs)
    return kernel, ideal


def abstract_engine(name: str, batch: int, context: int):
    """(statics, params, state, plan, pool buffer bytes, pool buffers, kv config, model config) of an engine
    serving ``name`` to ``batch`` requests of ``context`` tokens, as abstract shapes."""
    cfg, model = build_model(name)
    max_len = context + 2 * BLOCK_SIZE
    probe = plan(cfg.layers, block_size=BLOCK_SIZE, policy="vllm", num_blocks=2)
    num_blocks = batch * blocks_per_request(probe, max_len) + 1
    config = plan(cfg.layers, block_size=BLOCK_SIZE, policy="vllm", num_blocks=num_blocks)
    layout = Layout.from_config(config, max_model_len=max_len, max_requests=batch)
    graphdef, params = nnx.split(model)
    leaves, params_def = jax.tree.flatten(params)
    static = StepStatic(graphdef, params_def, layout, batch, "auto")
    state = EngineState(jax.eval_shape(lambda: init_state(layout)), jax.eval_shape(lambda: init_cache(config)),
                        jax.ShapeDtypeStruct((2,), jnp.uint32))
    plan_ = StepPlan(jax.ShapeDtypeStruct(((2 + len(SAMPLING)) * batch,), jnp.int32))
    pool = state.cache.buffers
    return static, leaves, state, plan_, min(b.size * b.dtype.itemsize for b in pool), len(pool), config, cfg


def lower(program: str, device: str, static, params, state, plan_) -> jax.stages.Lowered:
    mesh, platform, _ = DEVICES[device]
    with use_abstract_mesh(mesh):
        if program == "step":
            traced = STEP.trace(static, params, state, plan_)
        else:
            R = plan_.data.shape[0] // (2 + len(SAMPLING))
            traced = DECODE_STEPS.trace(static, DECODE_CALL_STEPS, params, state, plan_,
                                        jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32))
        return traced.lower(lowering_platforms=(platform,))


def project(name: str, device: str, batch: int, context: int, program: str) -> dict:
    """One row: lower ``program`` for ``device`` at ``batch`` requests of ``context`` tokens and count."""
    static, params, state, plan_, pool_bytes, num_pool, config, cfg = abstract_engine(name, batch, context)
    lowered = lower(program, device, static, params, state, plan_)
    found = audit_pool(lowered.as_text(), config.num_blocks, pool_bytes, num_pool)
    kernel, kv_ideal = kv_traffic(config, cfg, batch, context)
    weights = sum(math.prod(x.shape) * x.dtype.itemsize for x in params)
    logits = 3 * batch * cfg.vocab_size * 4
    total = weights + kernel + logits
    return {"config": name, "device": device, "program": program, "batch": batch, "context": context,
            "aliased_pool": found.aliased_pool, "pool_copies": found.pool_copies, "pool_ops": found.pool_ops,
            "bytes_per_step": total, "weights_bytes": weights, "kernel_bytes": kernel, "logits_bytes": logits,
            # The CUDA lowering has no cost analysis (None): the field is then None.
            "xla_unfused_bytes": _unfused_bytes(lowered),
            "ideal_bytes": weights + kv_ideal, "ratio": round(total / (weights + kv_ideal), 3),
            "projected_ms": round(total / DEVICES[device][2] * 1e3, 3)}


def _unfused_bytes(lowered) -> int | None:
    """XLA's bytes accessed by the unfused module, where the backend's lowering has a cost analysis."""
    cost = lowered.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    return None if not cost or "bytes accessed" not in cost else int(cost["bytes accessed"])


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.1f} GB"


def decode_engine(name: str, batch: int, context: int, decode_steps: int, decode_calls: int):
    """On the machine's own device: an engine serving ``name`` (random weights; a ``tiny-*`` preset too) to
    ``batch`` requests of ``context`` tokens, prefilled, with tokens left for ``decode_calls`` calls of
    ``decode_steps`` decode steps each (1: ``STEP``, more: ``DECODE_STEPS``), and two calls more: at most
    ``DECODE_ROOM`` tokens."""
    from hkv_jax.engine import Engine, SamplingParams

    new_tokens = decode_steps * (decode_calls + 2)
    if new_tokens > DECODE_ROOM:
        raise ValueError(f"{decode_calls} calls of {decode_steps} decode steps, and two more, need "
                         f"{new_tokens} new tokens a request; the engine has room for {DECODE_ROOM}")
    cfg, _ = build_model(name)
    model = (Gemma3LM if isinstance(cfg, Gemma3Config) else TinyLM)(cfg, nnx.Rngs(0))
    max_len = context + 2 * BLOCK_SIZE + DECODE_ROOM
    probe = plan(cfg.layers, block_size=BLOCK_SIZE, policy="vllm", num_blocks=2)
    budget = max(batch, 512)
    eng = Engine(model, num_blocks=batch * blocks_per_request(probe, max_len, cdiv(budget, batch)) + 1,
                 block_size=BLOCK_SIZE, max_requests=batch, max_model_len=max_len, token_budget=budget,
                 decode_steps=decode_steps)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        eng.add_request(rng.integers(1, cfg.vocab_size, context - 1).tolist(),
                        SamplingParams(new_tokens, min_tokens=new_tokens))
    while any(r.computed < len(r.prompt) for r in eng.requests.values()):  # the prefills
        eng.step()
    return eng


def timed_decode_calls(eng, calls: int, decode_steps: int) -> list[float]:
    """Seconds per decode step of each of ``calls`` calls of ``eng.step_tokens()``."""
    times = []
    for _ in range(calls):
        jax.block_until_ready(eng.state)
        t = time.perf_counter()
        eng.step_tokens()
        jax.block_until_ready(eng.state)
        times.append((time.perf_counter() - t) / decode_steps)
    return times


def measure(name: str, batch: int, context: int, decode_steps: int, repeats: int = 16) -> dict:
    """The median milliseconds of a decode step of ``decode_engine``'s engine, over ``repeats`` calls, and the
    device that ran it."""
    import statistics

    times = timed_decode_calls(decode_engine(name, batch, context, decode_steps, repeats), repeats, decode_steps)
    return {"measured_ms": round(statistics.median(times) * 1e3, 3), "measured_on": jax.devices()[0].device_kind}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--devices", default=",".join(DEVICES))
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="1024,4096,32768")
    p.add_argument("--programs", default="step,decode_steps")
    p.add_argument("--measure", action="store_true",
                   help="also run each row on this machine's device (random weights) and time its decode step")
    p.add_argument("--repeats", type=int, default=16, help="with --measure: timed calls, the median taken")
    p.add_argument("--json", action="store_true", help="print {\"rows\": [...]} as JSON")
    args = p.parse_args(argv)
    names, devices, programs = args.configs.split(","), args.devices.split(","), args.programs.split(",")
    tiny = [n for n in preset_names() if n.startswith("tiny-")]  # small enough to try --measure on a CPU
    for given, known, what in ((names, [*CONFIGS, *tiny], "config"), (devices, DEVICES, "device"),
                               (programs, ("step", "decode_steps"), "program")):
        bad = [x for x in given if x not in known]
        if bad:
            p.error(f"unknown {what} {bad[0]!r}; choose from {', '.join(known)}")
    try:
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        p.error("--batches and --contexts take comma-separated integers")
    if args.repeats < 1:
        p.error("--repeats must be positive")
    rows = []
    for name in names:
        for device in devices:
            for batch in batches:
                for context in contexts:
                    for program in programs:
                        t = time.perf_counter()
                        row = project(name, device, batch, context, program)
                        if args.measure:
                            row.update(measure(name, batch, context, 1 if program == "step" else DECODE_CALL_STEPS,
                                               args.repeats))
                            row["measured_gb_per_s"] = round(row["bytes_per_step"] / row["measured_ms"] / 1e6, 1)
                        rows.append(row)
                        print(f"{name:>18} {device:>7} {program:>12} B={batch:<4} ctx={context:<6} "
                              f"aliased={row['aliased_pool']!s:<5} copies={row['pool_copies']} {row['pool_ops']} "
                              f"bytes={row['bytes_per_step'] / 1e9:8.3f} GB ideal={row['ideal_bytes'] / 1e9:8.3f} GB "
                              f"x{row['ratio']:<6} {row['projected_ms']:8.2f} ms  (XLA unfused "
                              f"{_gb(row['xla_unfused_bytes'])}; {time.perf_counter() - t:.0f} s)",
                              file=sys.stderr, flush=True)
                        if args.measure:
                            print(f"{'':>18} measured {row['measured_ms']:.2f} ms against {row['projected_ms']:.2f} ms "
                                  f"projected: {row['measured_gb_per_s']:.0f} GB/s of "
                                  f"{DEVICES[device][2] / 1e9:.0f} GB/s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    bad = [r for r in rows if not r["aliased_pool"] or r["pool_copies"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
