"""Rollback for speculative decoding: try a draft continuation, reject it, return to the snapshot.

A snapshot copies the device state (allocator + KV memory + PRNG key) and the host bookkeeping;
`restore` puts them back, so the rejected draft leaves no trace: generation afterwards is bit-exact
what it would have been without the draft.

Run: python examples/rollback_speculative.py [--draft-steps 4] [--max-new-tokens 12] [--smoke]
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine, EngineConfig, SamplingParams
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM

CONFIG = EngineConfig(num_blocks=96, block_size=16, max_requests=4, max_model_len=256, token_budget=64)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft-steps", type=int, default=4, help="steps the rejected draft runs")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="the smallest run: a 2-step draft, 5 new tokens")
    args = p.parse_args(argv)
    draft_steps, new_tokens = (2, 5) if args.smoke else (args.draft_steps, args.max_new_tokens)
    if not 1 <= draft_steps < new_tokens:
        p.error("--draft-steps must be at least 1 and below --max-new-tokens")

    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-gemma3")[1]), nnx.Rngs(0))
    engine = Engine(model, CONFIG)
    prompt = np.random.default_rng(2).integers(0, 256, 40).tolist()
    # No temperature of its own: the request samples with the engine's default (greedy until changed).
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
    engine.step()  # prefill + first greedy token

    snap = engine.snapshot()
    engine.temperature = 1.5  # a wild draft
    for _ in range(draft_steps):
        engine.step()
    draft = engine.requests[rid].generated[1:]
    accepted = False  # a verifier (the target model) would check the draft here; say it rejects it
    print("draft tokens:", draft, "-> accepted" if accepted else "-> rejected")

    engine.restore(snap)  # back to the snapshot: blocks, tables, KV pages and key
    engine.temperature = 0.0
    after_rollback = engine.run()[rid]

    fresh = Engine(model, CONFIG)  # the same sizes: the same compiled programs
    fresh_rid = fresh.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
    reference = fresh.run()[fresh_rid]
    print("after rollback:", after_rollback)
    print("without draft: ", reference, "(identical)" if after_rollback == reference else "(DIFFERENT)")
    if after_rollback != reference:
        raise SystemExit("generation after restore differs from generation without the draft")


if __name__ == "__main__":
    main()
