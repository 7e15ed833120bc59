"""The host tier behind the prefix cache: hit rate, prefill work, host bytes per cached token, step time.

Serves two workloads on tiny random-weight models of three kinds (``tiny-gemma3``: 5 sliding-window
groups to 1 full, like Gemma 3; ``tiny-gemma4``: sliding and full groups of two block sizes, KV sharing;
``tiny-jamba``: Mamba + full), each with a device pool at about 15% of the workload's working set (the
blocks that would hold every request's prefix), once without a host tier and once with one of 8x the
device pool (``EngineConfig.host_cache_bytes``; ``--host-factor``):

- ``chat``: ``--conversations`` chats of ``--turns`` turns, ``--concurrency`` at a time; each turn's prompt
  is the conversation so far plus a new question (the multi-turn chat of ``window_eviction.py``, served);
- ``agent``: requests over a few long shared documents (``--documents`` of ``--document-tokens`` tokens),
  each the document plus its own short task, cycling over the documents.

Per model and workload it prints: the prefix-cache hit rate (hit tokens over prompt tokens) and the tokens
computed for prompts, with and without the tier; the host bytes the tier keeps per cached token (its
kept bytes, ``HostUsage.kept_bytes``, over the prefix tokens its full-attention blocks cover; with the
superseded blocks it still holds until room is needed: ``host_used_bytes_per_token``) against a naive tier
that keeps every group's block for every token; the median step time on and off (every step of the run, on
this CPU).
``--json`` prints ``{"rows": [...]}``, one row per model and workload.

Run: ``python benchmarks/host_tier.py [--models tiny-gemma3,tiny-gemma4,tiny-jamba] [--json]``
(a few minutes on 2 cores: each engine compiles its step programs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import plan

POLICY = {"tiny-jamba": "min-waste"}  # its Mamba states span pages there (the vllm plan caches none)
HOST_FACTOR = 8                       # host tier: this many device pools
DEVICE_SHARE = 0.15                   # device pool: about this share of the working set


def chat(rng, conversations: int, turns: int, question: int, answer: int):
    """``(turns of requests, answer tokens)``: each turn's prompts are filled in as the chat goes, from the
    conversation so far (``run`` appends the answers); here the new questions."""
    return [[[int(t) for t in rng.integers(0, 256, question)] for _ in range(conversations)]
            for _ in range(turns)], answer


def agent(rng, documents: int, document_tokens: int, requests: int, task: int):
    """The prompts of ``requests`` tasks over ``documents`` shared documents, cycling over them."""
    docs = [[int(t) for t in rng.integers(0, 256, document_tokens)] for _ in range(documents)]
    return [docs[i % documents] + [int(t) for t in rng.integers(0, 256, task)] for i in range(requests)]


def timed_steps(eng: Engine, times: list[float]) -> None:
    """Step until idle, each step's wall time into ``times``."""
    while eng.has_work:
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)


def run(eng: Engine, workload: str, args, seed: int) -> list[float]:
    """Serve ``workload`` on ``eng``; returns the step times."""
    rng = np.random.default_rng(seed)
    times: list[float] = []
    if workload == "chat":
        questions, answer = chat(rng, args.conversations, args.turns, args.question, args.answer)
        history = [[] for _ in range(args.conversations)]
        for turn in questions:
            ids = [eng.add_request(h + q, answer) for h, q in zip(history, turn)]
            timed_steps(eng, times)
            history = [eng.requests[rid].prompt + eng.requests[rid].generated for rid in ids]
    else:
        for prompt in agent(rng, args.documents, args.document_tokens, args.requests, args.question):
            eng.add_request(prompt, args.answer)
        timed_steps(eng, times)
    return times


def working_set(workload: str, args) -> int:
    """Tokens whose KV every request's prefix needs at once (what a pool that never evicts holds)."""
    if workload == "chat":
        return args.conversations * args.turns * (args.question + args.answer)
    return args.documents * args.document_tokens + args.requests * (args.question + args.answer)


def engine(model, name: str, workload: str, args, host_blocks: int) -> Engine:
    """An engine for ``workload`` whose pool holds ``DEVICE_SHARE`` of its working set (at least two
    requests), with a host tier of ``host_blocks`` blocks (0: none)."""
    max_len = (args.turns * (args.question + args.answer) if workload == "chat"
               else args.document_tokens + args.question + args.answer) + 16
    kv = plan(model.cfg.layers, block_size=args.block_size, policy=POLICY.get(name, "vllm"), num_blocks=2)
    per_request = kv.blocks_per_request(max_len + args.token_budget)
    blocks = max(int(DEVICE_SHARE * working_set(workload, args) * per_request / max_len), 2 * per_request) + 1
    return Engine(model, num_blocks=blocks, block_size=args.block_size, max_requests=args.concurrency,
                  max_model_len=max_len, token_budget=args.token_budget, token_buckets=(args.token_budget,),
                  impl="reference", policy=POLICY.get(name, "vllm"), host_cache_bytes=host_blocks * kv.bytes_per_block)


def measure(name: str, workload: str, args) -> dict:
    """One row: the workload served without and with a host tier."""
    model = TinyLM(TinyConfig.from_hf(resolve_model(name)[1]), nnx.Rngs(0))
    off = engine(model, name, workload, args, 0)
    on = engine(model, name, workload, args, int(args.host_factor * (off.config.num_blocks - 1)))
    result = {}
    for label, eng in (("off", off), ("on", on)):
        if not args.json:
            print(f"{name} {workload} {label}: {eng.config.num_blocks - 1} device blocks ...", file=sys.stderr,
                  flush=True)
        times = run(eng, workload, args, args.seed)
        s = eng.stats
        decode = sum(max(len(r.generated) - 1, 0) for r in eng.requests.values())
        result[label] = {"hit_rate": s.cache_hit_tokens / max(s.prompt_tokens, 1),
                         "prefill_tokens": s.tokens_computed - decode,
                         "step_ms": 1e3 * statistics.median(times[len(times) // 4:])}  # past the compiles
    usage = on.host_usage()
    layout = on.layout
    full = [g for g in range(layout.num_groups) if layout.groups[g].spec.keeps_every_token]
    covered = max((usage.cached_per_group[g] * layout.block_sizes[g] for g in full), default=0)
    naive = sum(on.block_bytes / bs for bs in layout.block_sizes)
    return {"model": name, "workload": workload, "device_blocks": on.config.num_blocks - 1,
            "host_bytes": usage.capacity_bytes, "hit_rate": round(result["on"]["hit_rate"], 3),
            "hit_rate_device_only": round(result["off"]["hit_rate"], 3),
            "prefill_tokens": result["on"]["prefill_tokens"],
            "prefill_tokens_device_only": result["off"]["prefill_tokens"],
            "host_bytes_per_token": round(usage.kept_bytes / max(covered, 1), 1),
            "host_used_bytes_per_token": round(usage.used_bytes / max(covered, 1), 1),
            "naive_host_bytes_per_token": round(naive, 1),
            "host_hit_tokens": usage.hit_tokens, "bytes_down": usage.bytes_down, "bytes_up": usage.bytes_up,
            "step_ms_on": round(result["on"]["step_ms"], 2), "step_ms_off": round(result["off"]["step_ms"], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-gemma3,tiny-gemma4,tiny-jamba")
    ap.add_argument("--workloads", default="chat,agent")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--question", type=int, default=40, help="tokens of a chat question or an agent's task")
    ap.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--document-tokens", type=int, default=600)
    ap.add_argument("--requests", type=int, default=12, help="agent tasks")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=128)
    ap.add_argument("--host-factor", type=float, default=HOST_FACTOR,
                    help="host tier size in device pools (a smaller tier fills: what it keeps then counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for m in args.models.split(","):
        for w in args.workloads.split(","):
            rows.append(measure(m, w, args))
            # XLA:CPU maps each compiled program's code: a dozen engines' programs exceed vm.max_map_count.
            jax.clear_caches()
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))
        return 0
    print(f"{'model':<12} {'workload':<8} {'dev blk':>7} {'hit on':>7} {'hit off':>7} {'prefill on':>10} "
          f"{'prefill off':>11} {'host B/tok':>10} {'naive B/tok':>11} {'step on':>8} {'step off':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['workload']:<8} {r['device_blocks']:>7} {r['hit_rate']:>7.3f} "
              f"{r['hit_rate_device_only']:>7.3f} {r['prefill_tokens']:>10} {r['prefill_tokens_device_only']:>11} "
              f"{r['host_bytes_per_token']:>10.0f} {r['naive_host_bytes_per_token']:>11.0f} "
              f"{r['step_ms_on']:>6.1f}ms {r['step_ms_off']:>6.1f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
