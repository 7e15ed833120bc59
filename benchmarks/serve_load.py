"""``hkv serve`` under load, as its clients see it: streamed completions over HTTP from C concurrent
clients; throughput, time to first token (TTFT), time per output token (TPOT) and latency percentiles,
the figures vLLM's ``benchmark_serving.py`` reports.

Workload: ``--requests`` prompts of ``--prompt-words`` random common English words (seeded), each asking
for exactly ``--max-tokens`` tokens (``min_tokens`` equal to ``max_tokens``: no early EOS, as vLLM's
``ignore_eos``), greedy, streamed with the usage last. ``--concurrency`` lists the client counts: each
client sends its next request when its last one ended (a closed loop), and every count gets its own
prompts. Timed per request from sending it: TTFT to the first event with text, TPOT as (end - TTFT) /
(tokens - 1), latency to ``[DONE]``; per run the wall time from the first request to the last answer.

Without ``--url`` it serves ``--model`` itself (``hkv_jax.serve.CompletionServer`` in this process,
``--max-requests`` at once), after a warm-up that compiles the step programs and serves one request of
the timed shape. With ``--url`` it loads a server already running (``hkv serve``).

Run: ``python benchmarks/serve_load.py [--model tiny-gptoss] [--url http://127.0.0.1:8000]
[--requests 32] [--concurrency 1,4,8] [--prompt-words 16] [--max-tokens 32] [--max-requests 8] [--json]``
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).parent))

# Common English words: prompts with ordinary text for a real tokenizer (a byte codec reads them too).
WORDS = ("the of and to in is was for on that with as by at from his her it an are were which this be or "
         "had not but have one all their new first after two also time who been they its more other into "
         "over year city can only most may some when part used under these people state between many "
         "world during such would early then there three work later school made known while like where "
         "war water game since team music house small long life name found river before high great").split()


def prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` prompts of ``words`` random words each (seeded)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() for _ in range(count)]


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """Send one streamed completion; its timings (seconds) and token counts. ``RuntimeError`` for a status
    other than 200 or an error event."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        first, usage = None, None
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            elif first is None and event["choices"][0]["text"]:
                first = time.perf_counter()
        end = time.perf_counter()
    finally:
        conn.close()
    tokens = usage["completion_tokens"]
    first = end if first is None else first
    return {"ttft": first - start, "latency": end - start, "tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"], "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0}


def run(url: str, texts: list[str], max_tokens: int, concurrency: int) -> dict:
    """Serve ``texts`` from ``concurrency`` clients at once; the summary row."""
    todo = list(reversed(texts))
    done: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not todo or errors:
                    return
                text = todo.pop()
            try:
                result = one_request(url, text, max_tokens)
            except (OSError, RuntimeError) as e:
                with lock:
                    errors.append(e)
                return
            with lock:
                done.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")

    def pct(name: str, q: float) -> float:
        values = sorted(r[name] for r in done)
        return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 1)

    tokens = sum(r["tokens"] for r in done)
    return {"concurrency": concurrency, "requests": len(done), "max_tokens": max_tokens,
            "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in done), 1),
            "output_tokens": tokens, "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(done) / wall, 3),
            "ttft_ms_p50": pct("ttft", 0.5), "ttft_ms_p90": pct("ttft", 0.9),
            "tpot_ms_p50": pct("tpot", 0.5), "tpot_ms_p90": pct("tpot", 0.9),
            "latency_ms_p50": pct("latency", 0.5), "latency_ms_p90": pct("latency", 0.9)}


def start_server(model: str, max_requests: int, max_model_len: int | None):
    """``model`` served in this process on a free port, its programs compiled; the server."""
    from hkv_jax.engine.factory import ServeConfig, build_engine
    from hkv_jax.models.tokenizer import ByteCodec
    from hkv_jax.serve import CompletionServer

    engine, codec = build_engine(ServeConfig(model=model, engine={"max_requests": max_requests,
                                                                  "max_model_len": max_model_len}),
                                 max_logit_bias=16)
    server = CompletionServer(engine, codec or ByteCodec(), model)
    host, port = server.start("127.0.0.1", 0, warm=True)
    server.url = f"http://{host}:{port}"
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: serve --model in this process)")
    p.add_argument("--model", default="tiny-gptoss", help="the model to serve without --url (default tiny-gptoss)")
    p.add_argument("--max-requests", type=int, default=8, help="requests the served engine runs at once (default 8)")
    p.add_argument("--max-model-len", type=int, help="the served engine's longest request (default: hkv serve's)")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency (default 32)")
    p.add_argument("--concurrency", default="1,4,8", help="client counts, comma-separated (default 1,4,8)")
    p.add_argument("--prompt-words", type=int, default=16, help="words per prompt (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or min(args.requests, args.prompt_words, args.max_tokens) < 1:
        p.error("--concurrency, --requests, --prompt-words and --max-tokens must be positive")
    import machine

    server = None
    if args.url is None:
        print(f"... serving {args.model} (compiling)", file=sys.stderr)
        server = start_server(args.model, args.max_requests, args.max_model_len)
    url = args.url or server.url
    try:
        one_request(url, prompts(1, args.prompt_words, args.seed + 1000)[0], args.max_tokens)  # warm-up
        rows = []
        for i, c in enumerate(levels):
            print(f"... concurrency {c}", file=sys.stderr)
            row = {"model": args.model if server else url, **run(url, prompts(args.requests, args.prompt_words,
                                                                             args.seed + i), args.max_tokens, c)}
            rows.append(row)
            if not args.json:
                print(f"{row['model']:14} C={c:<3} {row['requests']} requests, {row['output_tokens_per_s']} "
                      f"tok/s, {row['requests_per_s']} req/s; TTFT p50 {row['ttft_ms_p50']} ms p90 "
                      f"{row['ttft_ms_p90']} ms; TPOT p50 {row['tpot_ms_p50']} ms p90 {row['tpot_ms_p90']} ms; "
                      f"latency p50 {row['latency_ms_p50']} ms")
    finally:
        if server is not None:
            server.stop()
    machine.print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
