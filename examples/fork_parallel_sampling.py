"""Parallel sampling with `fork`: children share their parent's full KV blocks through ref counts.
Each sample has its own seed, so the samples are reproducible: a second engine draws the same ones.

Run: python examples/fork_parallel_sampling.py [--samples 4] [--max-new-tokens 10] [--smoke]
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine, EngineConfig, SamplingParams
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM

CONFIG = EngineConfig(num_blocks=96, block_size=16, max_requests=4, max_model_len=256, token_budget=64)


def parallel_samples(model, prompt: list[int], samples: int, new_tokens: int, verbose: bool) -> list[list[int]]:
    """``samples`` samples of ``prompt``: a request (seed 0) and forks of it after its prefill (seeds 1, 2, ...)."""
    engine = Engine(model, CONFIG)
    parent = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=0.95,
                                                       seed=0))
    engine.step()  # prefill and the first token: 50 tokens = 3 full blocks per group, plus one partial block

    # A fork samples with the parent's settings and a seed of its own (the parent is still running).
    children = [engine.fork(parent, seed=i) for i in range(1, samples)]
    if verbose:
        slot = engine.requests[parent].slot
        tables = np.asarray(engine.state.alloc.tables[slot])
        ref = np.asarray(engine.state.alloc.block_pool.free_queue.ref_count)
        full = tables[:, :3]
        counts = sorted({int(c) for c in ref[full[full > 0]]})
        print(f"ref counts of the parent's full blocks (1 parent + {samples - 1} children):", counts)

    out = engine.run()
    if verbose:
        for rid in [parent, *children]:
            print(f"sample {rid}: {out[rid]}")
        print("free blocks after all finished:", engine.kv_usage().free_blocks, "of", CONFIG.num_blocks - 1)
    return [out[rid] for rid in [parent, *children]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=4, help=f"samples of the prompt, at most {CONFIG.max_requests}")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="the smallest run: 2 samples of 4 tokens")
    args = p.parse_args(argv)
    samples, new_tokens = (2, 4) if args.smoke else (args.samples, args.max_new_tokens)
    if not 1 <= samples <= CONFIG.max_requests:
        p.error(f"--samples must be in [1, {CONFIG.max_requests}]")
    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-gemma3")[1]), nnx.Rngs(0))
    prompt = np.random.default_rng(1).integers(0, 256, 50).tolist()
    first = parallel_samples(model, prompt, samples, new_tokens, verbose=True)
    again = parallel_samples(model, prompt, samples, new_tokens, verbose=False)
    print("a second engine draws the same samples:", again == first)
    if again != first:
        raise SystemExit("the samples differ between two engines")


if __name__ == "__main__":
    main()
