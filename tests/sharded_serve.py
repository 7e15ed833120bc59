"""Serve a tiny model on one device and on (data, model) meshes; print tokens and allocator state as JSON.

Run by ``tests/test_sharding.py`` in a process of its own with 8 host devices and XLA's dump of the step
programs (``XLA_FLAGS=--xla_force_host_platform_device_count=8 --xla_dump_to=DIR
--xla_dump_hlo_module_re=jit_step``). Usage: ``sharded_serve.py MODEL DATAxMODEL ... [--attention]``
(``1x1``: no mesh, the single-device reference; ``--attention``: also one attention layer under a 2x4 mesh
against one device).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.quant import quantize_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.sharding import make_mesh

# KV heads that split 4 ways but not 8: the (1, 8) mesh replicates the pool, the (2, 4) mesh splits it.
# Each with a pool (blocks) small enough to preempt, and its weights' quantization (hkv_jax.models.quant).
MODELS = {
    "tiny-gptoss-8x4": ("tiny-gptoss", {"num_attention_heads": 8, "num_key_value_heads": 4}, 20, None),
    "tiny-gemma3-8x4-int8": ("tiny-gemma3", {"num_attention_heads": 8, "num_key_value_heads": 4}, 50, "int8"),
}


def model(name: str) -> TinyLM:
    """The named test model (random weights, seed 0)."""
    base, overrides, _, quantize = MODELS[name]
    lm = TinyLM(TinyConfig.from_hf({**resolve_model(base)[1], **overrides}), nnx.Rngs(0))
    return lm if quantize is None else quantize_model(lm, quantize)


def prompts(seed: int = 0) -> list[list[int]]:
    """Five prompts sharing a 24-token prefix (hits), one of them long (chunked prefill)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 24).tolist()
    return [system + rng.integers(0, 256, k).tolist() for k in (3, 9, 40, 1, 17)]


def serve(name: str, mesh) -> dict:
    """Tokens per request, logits of the last step and the allocator state after every request ended."""
    engine = Engine(model(name), num_blocks=MODELS[name][2], block_size=8, max_requests=4, max_model_len=80,
                    token_budget=32, token_buckets=(32,), mesh=mesh)
    rids = [engine.add_request(p, 6) for p in prompts()]
    compiled_before = _step_programs()
    logits = {rid: [] for rid in rids}
    t = time.perf_counter()
    while engine.has_work:
        for rid, _ in engine.step():
            logits[rid].append(np.asarray(engine.last_output.logits[engine.last_rows[rid]]).tolist())
    print(f"  served in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    alloc = {jax.tree_util.keystr(p): np.asarray(x).tolist()
             for p, x in jax.tree_util.tree_flatten_with_path(engine.state.alloc)[0]}
    pool = [getattr(b.sharding, "spec", None) for b in engine.state.cache.buffers]
    return {"tokens": [engine.requests[r].generated for r in rids], "logits": [logits[r] for r in rids],
            "preemptions": engine.stats.preemptions,
            "hits": engine.stats.cache_hit_tokens, "alloc": alloc, "pool_specs": [str(s) for s in pool],
            "split_weights": sum(not x.sharding.is_fully_replicated for x in engine.params),
            "shards": list(engine.state.cache.layout.shards),
            **collectives(_step_programs() - compiled_before)}


def _step_programs() -> set[Path]:
    """The step programs XLA has compiled in this process so far, as dumped (optimized HLO text)."""
    found = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if found is None:
        raise SystemExit("needs XLA_FLAGS with --xla_dump_to=DIR --xla_dump_hlo_module_re=jit_step "
                         "(tests/test_sharding.py sets it)")
    return set(Path(found.group(1)).glob("*.jit_step.cpu_after_optimizations.txt"))


def collectives(programs: set[Path]) -> dict:
    """What the step programs a serve compiled hold: their partition counts, how many all-reduces, and the
    op and result shape of every other collective, which moves data between the devices
    (``all-gather f32[20,2,4,8,32]{...}``: one of ``num_blocks`` rows gathers pages of the pool). Read from
    XLA's dump of the programs the engine ran (compiling one again to read it took as long as serving)."""
    if not programs:
        raise SystemExit("no step program was compiled while serving (a program reused from an earlier serve)")
    texts = [p.read_text() for p in sorted(programs)]
    return {"partitions": sorted({int(re.search(r"num_partitions=(\d+)", t).group(1)) if "num_partitions=" in t
                                  else 1 for t in texts}),
            "all_reduces": sum(len(re.findall(r" all-reduce(?:-start)?\(", t)) for t in texts),
            "moves": [f"{op} {shape}" for t in texts for shape, op in
                      re.findall(r"= (\S+) (all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", t)]}


def attention_errors(shape: tuple[int, int]) -> dict[str, list[float]]:
    """Per KV head count (4: split by head over the model axis; 1: replicated, query heads split): the largest
    difference between ``attention`` under a ``shape`` mesh and on one device, of its output (with the KV
    write, then reading only) and of the pool after the write."""
    import jax.numpy as jnp

    from hkv_jax.attention import attention, make_metadata
    from hkv_jax.cache import init_cache, layer_kv, set_layer_kv
    from hkv_jax.planner import plan
    from hkv_jax.spec import FullAttentionSpec

    rng = np.random.default_rng(1)
    mesh = make_mesh(*shape)
    tables = jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 0]], jnp.int32)
    starts, lens = jnp.asarray([0, 3, 10], jnp.int32), jnp.asarray([10, 7], jnp.int32)
    errors = {}
    for kv_heads in (4, 1):
        config = plan([FullAttentionSpec(name="a", num_kv_heads=kv_heads, head_size=16, dtype="float32")],
                      block_size=4, num_blocks=8)
        q, k, v = (jnp.asarray(rng.normal(size=(10, h, 16)), jnp.float32) for h in (8, kv_heads, kv_heads))
        view = jnp.asarray(rng.normal(size=(8, 2, kv_heads, 4, 16)), jnp.float32)  # what the pages hold
        outs = []
        for m in (None, mesh):
            def run(cache, q, k, v):
                cache = set_layer_kv(cache, "a", view)
                metadata = make_metadata(cache, [tables], starts, lens, 10)
                out, cache = attention("a", q, k, v, cache, metadata)
                again, _ = attention("a", q, None, None, cache, metadata)  # as a KV-sharing layer reads
                return jnp.stack([out, again]), layer_kv(cache, "a")

            with contextlib.nullcontext() if m is None else jax.set_mesh(m):
                out, pages = jax.jit(run)(init_cache(config, m), q, k, v)
            outs.append((np.asarray(out), np.asarray(pages)))
        errors[str(kv_heads)] = [float(np.abs(a - b).max()) for a, b in zip(*outs)]
    return errors


def main(argv: list[str]) -> int:
    name, shapes = argv[0], [a for a in argv[1:] if a != "--attention"]
    runs = {"attention": attention_errors((2, 4))} if "--attention" in argv else {}
    for shape in shapes:
        data, mod = map(int, shape.split("x"))
        t = time.perf_counter()
        runs[shape] = serve(name, None if (data, mod) == (1, 1) else make_mesh(data, mod))
        print(f"{shape}: {time.perf_counter() - t:.1f} s, pool parts {runs[shape]['shards']}, "
              f"collectives that move data {runs[shape]['moves']}", file=sys.stderr, flush=True)
    json.dump(runs, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
