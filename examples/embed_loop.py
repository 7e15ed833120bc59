"""Embed hkv-jax in your own serving loop: a tiny Flax NNX model, the engine, a streaming loop.

Run: python examples/embed_loop.py
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


def main() -> None:
    # 1. Your model: any TinyLM-like NNX module with a `paged(tokens, positions, cache, metadata)` method.
    _, hf_config = resolve_model("tiny-gptoss")
    model = TinyLM(TinyConfig.from_hf(hf_config), nnx.Rngs(0))

    # 2. The engine plans the KV pool from the model's layer specs (sliding + full groups share pages).
    engine = Engine(model, num_blocks=96, block_size=16, max_requests=4, max_model_len=256, token_budget=64)
    print("KV cache groups:", [f"{g.spec.kind} x{len(g.layer_names)}" for g in engine.config.groups])

    # 3. Your requests; here two share a prefix, so the second one hits the prefix cache.
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, 48).tolist()
    for tail in (8, 20, 5):
        engine.add_request(prefix + rng.integers(0, 256, tail).tolist(), max_new_tokens=8)

    # 4. Your loop: one jitted program per step; the host gets back the sampled tokens only.
    streams: dict[int, list[int]] = {}
    while engine.has_work:
        for rid, token in engine.step():
            streams.setdefault(rid, []).append(token)
    for rid, toks in sorted(streams.items()):
        print(f"request {rid}: {toks} (prefix-cache hit: {engine.requests[rid].cache_hit} tokens)")
    s = engine.stats
    print(f"{s.steps} steps, {s.host_to_device_bytes} bytes host->device, {s.device_to_host} reads back")


if __name__ == "__main__":
    main()
