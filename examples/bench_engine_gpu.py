"""End-to-end serving step time (the engine's step programs: full and lean decode) for the tiny models, on any backend.

Runs the `hkv demo` workload per model and prints the median step time after warm-up and the
throughput. On a GPU the kernels are Mosaic GPU (Hopper) or Triton; elsewhere the jnp reference.
Run: python examples/bench_engine_gpu.py [--models tiny-gemma3,tiny-gptoss,tiny-llama4] [--requests 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from hkv_jax.demo import DemoConfig, build_engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny-gemma3,tiny-gptoss,tiny-llama4")
    p.add_argument("--requests", type=int, default=48)
    a = p.parse_args()
    print(f"# device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for name in a.models.split(","):
        engine = build_engine(DemoConfig(model=name, num_blocks=1024, max_requests=16, token_budget=256))
        for i in range(a.requests):
            engine.add_request([(7 * i + j) % 256 for j in range(64 + i % 32)], 16)
        engine.step()  # compile
        times = []
        while engine.has_work:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        s = engine.stats
        print(f"{name:12s} median step {1e3 * statistics.median(times):8.2f} ms over {len(times)} steps, "
              f"{s.generated / sum(times):8.1f} generated tok/s")


if __name__ == "__main__":
    main()
