"""Score multiple-choice continuations through ``hkv serve``, as evaluation harnesses do (lm-eval's
loglikelihood requests): each context + continuation goes out with ``echo``, ``logprobs: 1`` and
``max_tokens: 0``; the continuation's log-likelihood is the sum of its tokens' log-probabilities (the
tokens whose ``text_offset`` lies past the context), and it is greedy when each of its tokens is the
likeliest at its position. The choice with the highest log-likelihood is the model's answer.

Run: ``hkv serve --model gemma-3-270m`` in one shell, then ``python examples/score_choices.py``
(``--url``, ``--api-key``, ``--json``, ``--smoke``: the first two questions). It needs nothing but the
standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request

NEEDS_SERVER = True  # tests/test_examples.py runs it against a server of a tiny model (``--url``)
# (context, choices, the right choice's index)
QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " pressure"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Monday, Tuesday, Wednesday,", [" Thursday", " Sunday", " Friday"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mercury", " Mars"], 0),
]


def score(url: str, contexts_and_continuations: list[tuple[str, str]], api_key: str | None = None
          ) -> list[tuple[float, bool]]:
    """``(log-likelihood, greedy)`` of each continuation after its context, from one batched request."""
    body = {"prompt": [c + x for c, x in contexts_and_continuations], "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        choices = sorted(json.load(resp)["choices"], key=lambda c: c["index"])
    out = []
    for (context, _), choice in zip(contexts_and_continuations, choices):
        lp = choice["logprobs"]
        # The continuation's tokens: those that start at or past the end of the context's text.
        at = [i for i, offset in enumerate(lp["text_offset"]) if offset >= len(context)]
        if not at:
            raise ValueError(f"the continuation after {context!r} got no token of its own")
        values = [lp["token_logprobs"][i] for i in at]
        greedy = all(abs(max(lp["top_logprobs"][i].values()) - v) < 1e-6 for i, v in zip(at, values))
        out.append((sum(values), greedy))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("HKV_API_KEY"), help="its API key, if it has one")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--smoke", action="store_true", help="the smallest run: the first two questions")
    args = p.parse_args(argv)
    questions = QUESTIONS[:2] if args.smoke else QUESTIONS
    pairs = [(context, choice) for context, choices, _ in questions for choice in choices]
    scores = iter(score(args.url, pairs, args.api_key))
    results, right = [], 0
    for context, choices, answer in questions:
        scored = [next(scores) for _ in choices]
        pick = max(range(len(choices)), key=lambda i: scored[i][0])
        right += pick == answer
        results.append({"context": context, "choices": choices, "loglikelihood": [s for s, _ in scored],
                        "greedy": [g for _, g in scored], "pick": pick, "answer": answer})
        if not args.json:
            row = ", ".join(f"{c!r} {s:.2f}{' (greedy)' if g else ''}" for c, (s, g) in zip(choices, scored))
            print(f"{context!r}: {row} -> {choices[pick]!r}{'' if pick == answer else ' (wrong)'}")
    if args.json:
        print(json.dumps({"results": results, "right": right, "questions": len(questions)}))
    else:
        print(f"{right}/{len(questions)} right")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
