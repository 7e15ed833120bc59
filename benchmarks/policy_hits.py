"""Prefix-cache hit rate of the two planner policies on a multi-turn chat with a Gemma-4-like model.

The model: 12 layers, 5 sliding-window : 1 full attention, the full layers' pages half the sliding ones'
(sliding 4 KV heads x 32, full 1 x 64), as in Gemma 4 31B. ``vllm`` gives the full-attention group
32 tokens per block against the sliding groups' 16, so hits and caching land on 32-token boundaries;
``min-waste`` keeps 16 tokens per block everywhere and packs two full-attention layers in one page slot.
Both get the same bytes of KV memory (``--num-blocks`` counts ``vllm``'s blocks; ``min-waste``'s blocks are
half the size, so it gets twice as many). The chat trace is ``window_eviction.py``'s (every turn's
prompt is the conversation so far plus a question; other chats' turns run in between), replayed
through the jitted allocator (``hkv replay``) under each policy. Reported: cache-hit tokens over prompt
tokens, and over the tokens a perfect cache with 16-token blocks could have served.
Run: ``python benchmarks/policy_hits.py [--num-blocks 1500,2000] [--seeds 0,1,2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from window_eviction import chat_options, hit_rates, print_hit_table, traces

from hkv_jax.allocator.replay import run_trace, trace_config

POLICIES = ("vllm", "min-waste")


def gemma4_like(window: int) -> dict:
    """12 layers: 5 sliding (``window``; 4 KV heads x 32) : 1 full (1 KV head x 64: half the page per token)."""
    sliding = {"type": "sliding_window", "sliding_window": window, "num_kv_heads": 4, "head_size": 32,
               "dtype": "bfloat16"}
    return {"num_layers": 12, "pattern": [sliding] * 5 + [{"type": "full", "num_kv_heads": 1, "head_size": 64,
                                                           "dtype": "bfloat16"}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    chat_options(ap, "1500,2000", "vllm's pool sizes (null block included); min-waste gets the same bytes",
                 question=40, answer=100, window=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for nb, seed, trace in traces(args, 16, gemma4_like(args.window)):
        vllm_bytes = nb * trace_config(trace, "vllm").bytes_per_block
        for policy in POLICIES:
            blocks = vllm_bytes // trace_config({**trace, "num_blocks": 2}, policy).bytes_per_block
            t0 = time.perf_counter()
            r = hit_rates(trace, run_trace({**trace, "num_blocks": blocks}, policy=policy))
            cfg = trace_config({**trace, "num_blocks": blocks}, policy)
            rows.append({"vllm_blocks": nb, "seed": seed, "policy": policy, "num_blocks": blocks,
                         "groups": len(cfg.groups), "hit_unit": cfg.scheduler_block_size, **r})
            print(f"vllm blocks {nb} seed {seed} {policy:<9}: {blocks} blocks, {len(cfg.groups)} groups, "
                  f"hit unit {cfg.scheduler_block_size}: hit rate {100 * r['hit_rate']:.1f}% "
                  f"({100 * r['hit_of_ideal']:.1f}% of ideal) [{time.perf_counter() - t0:.1f} s]",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print_hit_table(args, rows, "vllm_blocks", "memory (vllm blocks)", "policy", [(p, p) for p in POLICIES])
    return 0


if __name__ == "__main__":
    sys.exit(main())
