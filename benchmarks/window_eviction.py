"""Window-aware eviction: prefix-cache hit rate of a multi-turn chat on a sliding-window + full model.

Writes a trace (``docs/trace-format.md``) of ``--conversations`` chats of ``--turns`` turns each, served
``--concurrency`` requests at a time: every turn's prompt is the whole conversation so far plus a new
question, and every answer is decoded one token per step. Turns of other conversations run between two
turns of one chat, so under a small pool some cached history is evicted before it is asked for again.
The trace is replayed twice through the jitted allocator (``hkv replay``), with vLLM's eviction order
and with window-aware eviction, and the script prints the hit rate of each: cache-hit tokens over
prompt tokens, and over the tokens a perfect cache could have served (the full blocks of the history
that earlier requests computed).
``--system-prompt N`` starts every chat with the same N tokens (a prefix shared across chats).
Run: ``python benchmarks/window_eviction.py [--num-blocks 700,900] [--seeds 0,1,2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from hkv_jax.allocator.replay import run_trace


def sliding_and_full(window: int) -> dict:
    """The default model: 4 layers alternating full attention and a sliding window (2 KV heads x 64)."""
    layer = {"num_kv_heads": 2, "head_size": 64, "dtype": "bfloat16"}
    return {"num_layers": 4, "pattern": [{"type": "full", **layer},
                                         {"type": "sliding_window", "sliding_window": window, **layer}]}


def make_trace(conversations: int, turns: int, concurrency: int, question: int, answer: int, window: int,
               block_size: int, num_blocks: int, system_prompt: int, seed: int,
               layer_pattern: dict | None = None) -> dict:
    """The trace: chats admitted in order, a finished turn's next turn queued behind every waiting one.
    ``layer_pattern`` (the trace format's): the model, ``sliding_and_full(window)`` by default."""
    rng = np.random.default_rng(seed)
    tok = lambda n: [int(t) for t in rng.integers(1, 50_000, n)]  # noqa: E731
    system = tok(system_prompt)
    history = {c: list(system) for c in range(conversations)}
    queue = [(c, 0) for c in range(conversations)]
    running: dict[str, list] = {}  # id -> [conversation, turn, tokens, answer tokens left]
    steps, n = [], 0
    computed_before = {}  # request -> tokens of its prompt whose KV an earlier request computed
    while queue or running:
        events = []
        for rid, r in list(running.items()):
            if r[3] == 0:  # the turn is over: its answer joins the history
                events.append({"op": "free", "id": rid})
                history[r[0]] = r[2]
                if r[1] + 1 < turns:
                    queue.append((r[0], r[1] + 1))
                del running[rid]
            else:
                t = tok(1)
                events.append({"op": "schedule", "id": rid, "num_tokens": 1, "output_tokens": t})
                r[2] += t
                r[3] -= 1
        while queue and len(running) < concurrency:
            c, turn = queue.pop(0)
            rid, n = f"c{c}t{turn}", n + 1
            # The history's last token was sampled, never computed (turn > 0); the system prompt was
            # computed by the first chat.
            computed_before[rid] = len(history[c]) - 1 if turn else system_prompt * (n > 1)
            # Lengths vary by up to half the mean either way (the seed changes the workload's shape).
            prompt = history[c] + tok(int(rng.integers(question // 2, question * 3 // 2 + 1)))
            first = tok(1)
            events += [{"op": "add", "id": rid, "prompt": prompt},
                       {"op": "schedule", "id": rid, "num_tokens": "all", "output_tokens": first}]
            running[rid] = [c, turn, prompt + first, int(rng.integers(answer // 2, answer * 3 // 2 + 1)) - 1]
        steps.append(events)
    return {
        "name": f"multiturn_sw{window}_b{num_blocks}_s{seed}",
        "description": "multi-turn chat on a sliding-window + full model (benchmarks/window_eviction.py)",
        "block_size": block_size, "num_blocks": num_blocks, "enable_caching": True,
        "max_model_len": system_prompt + turns * (question + answer) * 3 // 2 + block_size,
        "prefix_cache_retention_interval": None,
        "layer_pattern": layer_pattern or sliding_and_full(window),
        "steps": steps,
        "computed_before": computed_before,  # informational (ignored by replay): the ideal hits
    }


def hit_rates(trace: dict, result: dict) -> dict:
    """Hit tokens over prompt tokens and over the block-aligned history a perfect cache would serve."""
    bs = trace["block_size"]
    prompts = {ev["id"]: len(ev["prompt"]) for evs in trace["steps"] for ev in evs if ev["op"] == "add"}
    firsts = [e for e in result["events"] if "cache_hit_tokens" in e]
    if any(e["ok"] is False for e in result["events"] if e["op"] == "schedule"):
        raise RuntimeError("an allocation was refused: raise --num-blocks or lower --concurrency")
    hits = sum(e["cache_hit_tokens"] for e in firsts)
    # A perfect cache serves every full block computed before, capped like any hit at prompt length - 1.
    ideal = sum(min(h, prompts[r] - 1) // bs * bs for r, h in trace["computed_before"].items())
    return {"hit_tokens": hits, "prompt_tokens": sum(prompts.values()), "ideal_hit_tokens": ideal,
            "hit_rate": hits / sum(prompts.values()), "hit_of_ideal": hits / max(ideal, 1)}


def print_hit_table(args, rows: list[dict], size: str, size_label: str, column: str, columns: list[tuple]) -> None:
    """The summary: per pool size (``rows[size]``), per column (label, value of ``rows[column]``), the mean hit
    rate over seeds and, in parentheses, its share of the ideal."""
    print(f"# {platform.machine()}, window {args.window}, {args.conversations} chats x {args.turns} turns, "
          f"concurrency {args.concurrency}, system prompt {args.system_prompt}")
    print(f"{size_label:>20} " + " ".join(f"{label:>15}" for label, _ in columns)
          + "   (mean hit rate over seeds; % of ideal)")
    for n in sorted({r[size] for r in rows}):
        cells = []
        for _, value in columns:
            sel = [r for r in rows if r[size] == n and r[column] == value]
            cells.append(f"{100 * statistics.mean(r['hit_rate'] for r in sel):5.1f}% "
                         f"({100 * statistics.mean(r['hit_of_ideal'] for r in sel):4.1f})")
        print(f"{n:>20} " + " ".join(f"{c:>15}" for c in cells))


def chat_options(ap: argparse.ArgumentParser, num_blocks: str, blocks_help: str, question: int, answer: int,
                 window: int) -> None:
    """The chat workload's options (``make_trace``'s), with these defaults."""
    ap.add_argument("--num-blocks", default=num_blocks, help=blocks_help)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--question", type=int, default=question, help="mean new prompt tokens per turn")
    ap.add_argument("--answer", type=int, default=answer, help="mean generated tokens per turn")
    ap.add_argument("--window", type=int, default=window)
    ap.add_argument("--system-prompt", type=int, default=0, help="tokens every chat starts with")


def traces(args, block_size: int, layer_pattern: dict | None = None):
    """``(pool size, seed, trace)`` for every ``--num-blocks`` and ``--seeds`` of ``chat_options``."""
    for nb in map(int, args.num_blocks.split(",")):
        for seed in map(int, args.seeds.split(",")):
            yield nb, seed, make_trace(args.conversations, args.turns, args.concurrency, args.question, args.answer,
                                       args.window, block_size, nb, args.system_prompt, seed, layer_pattern)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    chat_options(ap, "700,900", "pool sizes (null block included), comma-separated; the defaults hold every "
                                "running turn", question=32, answer=192, window=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--trace-out", help="also write the first trace here (replay it with hkv replay or vLLM)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for nb, seed, trace in traces(args, args.block_size):
        if args.trace_out and not rows:
            with open(args.trace_out, "w") as f:
                json.dump(trace, f)
        for aware in (False, True):
            t0 = time.perf_counter()
            r = hit_rates(trace, run_trace(trace, window_aware_eviction=aware))
            rows.append({"num_blocks": nb, "seed": seed, "window_aware": aware, **r})
            print(f"blocks {nb} seed {seed} {'window-aware' if aware else 'vLLM order  '}: hit rate "
                  f"{100 * r['hit_rate']:.1f}% ({100 * r['hit_of_ideal']:.1f}% of ideal) "
                  f"[{time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print_hit_table(args, rows, "num_blocks", "blocks", "window_aware", [("vLLM order", False), ("window-aware", True)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
