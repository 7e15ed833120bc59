"""End-to-end serving step time (the engine's step programs: full and lean decode) for the tiny models, on any backend.

Runs a workload of the `hkv demo`'s sizes per model and prints the median step time after warm-up and the
throughput. On a GPU the kernels are Mosaic GPU (Hopper) or Triton; elsewhere the jnp reference.
Run: python examples/bench_engine_gpu.py [--models tiny-gemma3,tiny-gptoss,tiny-llama4] [--requests 48] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from flax import nnx

from hkv_jax.engine import Engine, EngineConfig, SamplingParams
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


def bench(model: str, requests: int, new_tokens: int, config: EngineConfig) -> str:
    """One model's line (random weights): median step time over the steps after the first (which compiles),
    generated tokens/s."""
    engine = Engine(TinyLM(TinyConfig.from_hf(resolve_model(model)[1]), nnx.Rngs(0)), config)
    for i in range(requests):
        engine.add_request([(7 * i + j) % 256 for j in range(64 + i % 32)], SamplingParams(max_new_tokens=new_tokens))
    engine.step()  # compile
    times = []
    while engine.has_work:
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    generated = engine.stats.generated
    return (f"{model:12s} median step {1e3 * statistics.median(times):8.2f} ms over {len(times)} steps, "
            f"{generated / sum(times):8.1f} generated tok/s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny-gemma3,tiny-gptoss,tiny-llama4")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--smoke", action="store_true",
                   help="the smallest run: tiny-gemma3, 4 requests of 3 tokens in a pool of 96 blocks")
    a = p.parse_args(argv)
    models, requests, new_tokens = (["tiny-gemma3"], 4, 3) if a.smoke else (a.models.split(","), a.requests,
                                                                            a.max_new_tokens)
    config = (EngineConfig(num_blocks=96, block_size=16, max_requests=4, max_model_len=256, token_budget=64)
              if a.smoke else
              EngineConfig(num_blocks=1024, block_size=16, max_requests=16, max_model_len=256, token_budget=256))
    print(f"# device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for name in models:
        print(bench(name, requests, new_tokens, config), flush=True)


if __name__ == "__main__":
    main()
