"""The engine on this machine's own kernels against the dense, uncached model: same greedy tokens, close logits.

``tests/test_engine.py``'s parity workload (imported from it: the suite's workload and pools, so a GPU runs
what CI checks): for each ``--cases`` entry (``model:policy``), four prompts that share a 40-token system
prompt (prefix-cache hits) are served greedily in a pool small enough to preempt, with ``impl`` (``auto``: the
kernels this device picks); each request's tokens and logits are compared with the dense model's. Matmuls run
at full float32 precision, so the logits of both paths agree to rounding. One JSON row per case: ``{"bench":
"parity", "model", "policy", "impl", "device", "requests", "tokens_equal", "max_logit_err", "all_freed",
"preemptions", "hit_tokens", "seconds"}``; a case that raises reports ``error`` and the next one runs.

Run: ``python benchmarks/gpu_parity.py [--cases tiny-gemma3:vllm,...] [--impl auto]``; ``--smoke``: one small
case on CPU (CI).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine import MAX_LEN, NEW_TOKENS, PARITY_BLOCKS, dense_greedy, tiny, workload  # noqa: E402

from hkv_jax.engine import Engine  # noqa: E402

DEFAULT_CASES = "tiny-gemma3:vllm,tiny-gemma4:vllm,tiny-jamba:min-waste"


def parity(name: str, policy: str, impl: str, requests: int, new_tokens: int) -> dict:
    """One case's row: the first ``requests`` prompts, ``new_tokens`` greedy tokens each."""
    model = tiny(name)
    eng = Engine(model, num_blocks=PARITY_BLOCKS[name, policy], block_size=8, max_requests=4, max_model_len=MAX_LEN,
                 token_budget=32, token_buckets=(32,), impl=impl, policy=policy)
    work = workload()[:requests]
    ids = [eng.add_request(p, new_tokens) for p in work]
    logits = {rid: [] for rid in ids}
    while eng.has_work:
        for rid, _ in eng.step():
            logits[rid].append(np.asarray(eng.last_output.logits[eng.last_rows[rid]]))
    equal, err = 0, 0.0
    for rid, p in zip(ids, work):
        want, want_logits = dense_greedy(model, p, new_tokens)
        equal += eng.requests[rid].generated == want
        err = max(err, float(np.abs(np.stack(logits[rid]) - np.stack(want_logits)).max()))
    freed = int(eng.state.alloc.block_pool.free_queue.num_free) == eng.layout.num_blocks - 1
    return {"requests": len(ids), "tokens_equal": equal, "max_logit_err": err, "all_freed": freed,
            "preemptions": eng.stats.preemptions, "hit_tokens": eng.stats.cache_hit_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="model:policy,... (" + ", ".join(
        f"{m}:{q}" for m, q in sorted(PARITY_BLOCKS)) + ")")
    p.add_argument("--impl", default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny-gptoss, two requests of 3 tokens (CI on CPU)")
    a = p.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    unknown = [c for c in cases if c not in PARITY_BLOCKS]
    if unknown:
        p.error(f"unknown case {':'.join(unknown[0])}; choose from "
                + ", ".join(f"{m}:{q}" for m, q in sorted(PARITY_BLOCKS)))
    if a.smoke:
        cases = [("tiny-gptoss", "vllm")]
    jax.config.update("jax_default_matmul_precision", "highest")
    failed = 0
    for name, policy in cases:
        t0 = time.perf_counter()
        row = {"bench": "parity", "model": name, "policy": policy, "impl": a.impl,
               "device": jax.devices()[0].device_kind}
        try:
            row.update(parity(name, policy, a.impl, *((2, 3) if a.smoke else (4, NEW_TOKENS.get(name, 6)))))
        except Exception as e:  # report it and go on with the next case
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        failed += "error" in row or row["tokens_equal"] < row["requests"] or not row["all_freed"]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
