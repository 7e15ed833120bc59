"""Embed hkv-jax in your own serving loop: a tiny Flax NNX model, the engine, a streaming loop.

Run: python examples/embed_loop.py [--model tiny-gemma3] [--max-new-tokens 8] [--smoke]
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine, EngineConfig, SamplingParams
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-gemma3", help="a tiny preset (random weights)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="the smallest run: 4 new tokens per request")
    args = p.parse_args(argv)
    new_tokens = 4 if args.smoke else args.max_new_tokens

    # 1. Your model: any NNX module with the hkv_jax.models.PagedModel protocol (cfg.layers, cfg.vocab_size,
    #    paged(tokens, positions, cache, metadata)).
    model = TinyLM(TinyConfig.from_hf(resolve_model(args.model)[1]), nnx.Rngs(0))

    # 2. The engine plans the KV pool from the model's layer specs (sliding + full groups share pages).
    #    EngineConfig(max_top_logprobs=k) would let requests also see the k likeliest tokens of each step.
    engine = Engine(model, EngineConfig(num_blocks=96, block_size=16, max_requests=4, max_model_len=256,
                                        token_budget=64))
    print("KV cache groups:", [f"{g.spec.kind} x{len(g.layer_names)}" for g in engine.kv_cache_config.groups])

    # 3. Your requests; here they share a prefix, so the later ones hit the prefix cache. Each samples its
    #    own way (SamplingParams; the default is greedy).
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, 48).tolist()
    ids = [engine.add_request(prefix + rng.integers(0, 256, tail).tolist(), SamplingParams(max_new_tokens=new_tokens))
           for tail in (8, 20, 5)]
    # With a seed, its tokens do not depend on the batch it lands in: rerun it anywhere, get the same.
    sampled = engine.add_request(prefix + [1, 2, 3], SamplingParams(
        max_new_tokens=new_tokens, temperature=0.8, top_p=0.9, seed=7, logprobs=True))

    # 4. Your loop: one jitted program per step; the host gets back the sampled tokens only. Here the
    #    client of the second request goes away after its third token: abort it, its blocks come free.
    streams: dict[int, list[int]] = {}
    while engine.has_work:
        for rid, token in engine.step():
            streams.setdefault(rid, []).append(token)
        if len(streams.get(ids[1], [])) >= 3:
            engine.abort(ids[1])
    for rid, toks in sorted(streams.items()):
        r = engine.requests[rid]
        how = "aborted" if r.aborted else "sampled at 0.8 / top-p 0.9, seed 7" if rid == sampled else "greedy"
        ttft = (r.first_token_time - r.arrival_time) * 1e3  # here mostly compiling the step programs
        print(f"request {rid} ({how}): {toks}, finish reason {r.finish_reason!r} (prefix-cache hit: "
              f"{r.cache_hit} tokens; first token after {ttft:.0f} ms)")
        if r.logprobs is not None:
            print(f"  log-probabilities of its tokens: {[round(x, 2) for x in r.logprobs]}")
    s = engine.stats
    print(f"{s.steps} steps, {s.host_to_device_bytes} bytes host->device, {s.device_to_host} reads back; "
          f"KV pool after: {engine.kv_usage()}")


if __name__ == "__main__":
    main()
