"""Rollback for speculative decoding: try a draft continuation, reject it, return to the snapshot.

A snapshot copies the device state (allocator + KV memory + PRNG key) and the host bookkeeping;
`restore` puts them back, so the rejected draft leaves no trace: generation afterwards is bit-exact
what it would have been without the draft.

Run: python examples/rollback_speculative.py
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


def main() -> None:
    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-llama4")[1]), nnx.Rngs(0))
    engine = Engine(model, num_blocks=96, block_size=8, max_requests=2, max_model_len=128, token_budget=64)
    rid = engine.add_request(np.random.default_rng(2).integers(0, 256, 40).tolist(), max_new_tokens=12)
    engine.step()  # prefill + first greedy token

    snap = engine.snapshot()
    engine.temperature = 1.5  # a wild draft
    for _ in range(4):
        engine.step()
    draft = engine.requests[rid].generated[1:]
    greedy_ok = False  # a verifier (the target model) would check the draft here; say it rejects
    print("draft tokens:", draft, "-> rejected" if not greedy_ok else "-> accepted")

    engine.restore(snap)  # back to the snapshot: blocks, tables, KV pages and key
    engine.temperature = 0.0
    after_rollback = engine.run()[rid]

    fresh = Engine(model, num_blocks=96, block_size=8, max_requests=2, max_model_len=128, token_budget=64)
    fresh.add_request(engine.requests[rid].prompt, max_new_tokens=12)
    reference = fresh.run()[0]
    print("after rollback:", after_rollback)
    print("without draft: ", reference, "(identical)" if after_rollback == reference else "(DIFFERENT)")


if __name__ == "__main__":
    main()
