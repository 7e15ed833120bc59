"""Parallel sampling with `fork`: children share their parent's full KV blocks through ref counts.
Each sample has its own seed, so the samples are reproducible: a second engine draws the same ones.

Run: python examples/fork_parallel_sampling.py
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


def parallel_samples(model, prompt: list[int], verbose: bool) -> list[list[int]]:
    """Four samples of ``prompt``: a request and three forks of it after its prefill, seeds 0-3."""
    engine = Engine(model, num_blocks=96, block_size=8, max_requests=4, max_model_len=128, token_budget=64)
    engine.temperature, engine.top_p = 1.0, 0.95
    parent = engine.add_request(prompt, max_new_tokens=10, seed=0)
    engine.step()  # prefill: 50 tokens = 6 full blocks per group, plus one partial block

    children = [engine.fork(parent, seed=i) for i in (1, 2, 3)]
    if verbose:
        slot = engine.requests[parent].slot
        tables = np.asarray(engine.state.alloc.tables[slot])
        ref = np.asarray(engine.state.alloc.block_pool.free_queue.ref_count)
        full = tables[:, :6]
        counts = sorted({int(c) for c in ref[full[full > 0]]})
        print("ref counts of the parent's full blocks (1 parent + 3 children):", counts)

    out = engine.run()
    if verbose:
        for rid in [parent, *children]:
            print(f"sample {rid}: {out[rid]}")
        print("free blocks after all finished:", int(engine.state.alloc.block_pool.free_queue.num_free),
              "of", engine.layout.num_blocks - 1)
    return [out[rid] for rid in [parent, *children]]


def main() -> None:
    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-gemma3")[1]), nnx.Rngs(0))
    prompt = np.random.default_rng(1).integers(0, 256, 50).tolist()
    first = parallel_samples(model, prompt, verbose=True)
    print("a second engine draws the same samples:", parallel_samples(model, prompt, verbose=False) == first)


if __name__ == "__main__":
    main()
