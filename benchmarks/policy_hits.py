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
Run: ``python benchmarks/policy_hits.py [--num-blocks 250,400] [--seeds 0,1,2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from window_eviction import hit_rates, make_trace

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
    ap.add_argument("--num-blocks", default="250,400", help="vllm's pool sizes (null block included); min-waste "
                                                            "gets the same bytes")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--question", type=int, default=40, help="mean new prompt tokens per turn")
    ap.add_argument("--answer", type=int, default=100, help="mean generated tokens per turn")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--system-prompt", type=int, default=0, help="tokens every chat starts with")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for nb in map(int, args.num_blocks.split(",")):
        for seed in map(int, args.seeds.split(",")):
            trace = make_trace(args.conversations, args.turns, args.concurrency, args.question, args.answer,
                               args.window, 16, nb, args.system_prompt, seed, gemma4_like(args.window))
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
    print(f"# {platform.machine()}, window {args.window}, {args.conversations} chats x {args.turns} turns, "
          f"concurrency {args.concurrency}, system prompt {args.system_prompt}")
    print(f"{'memory (vllm blocks)':>21} {'vllm':>15} {'min-waste':>15}   (mean hit rate over seeds; % of ideal)")
    for nb in sorted({r["vllm_blocks"] for r in rows}):
        cell = []
        for policy in POLICIES:
            sel = [r for r in rows if r["vllm_blocks"] == nb and r["policy"] == policy]
            cell.append(f"{100 * statistics.mean(r['hit_rate'] for r in sel):5.1f}% "
                        f"({100 * statistics.mean(r['hit_of_ideal'] for r in sel):4.1f})")
        print(f"{nb:>21} {cell[0]:>15} {cell[1]:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
