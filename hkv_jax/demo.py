"""``hkv demo``: serve a synthetic multi-turn chat on an embedded tiny hybrid model.

Conversations share one system prompt; each turn's prompt is the previous
turn's prompt + answer + a new user message, and is submitted when the
previous turn finishes, so later turns find their history in the prefix
cache. Prints a progress bar, then tokens/s, steps/s, the prefix-cache hit
rate, blocks in use per KV cache group (peak) and the memory an all-full-
attention cache would have needed at the same peak.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import cdiv, plan
from hkv_jax.spec import MambaSpec

TINY_MODELS = ("tiny-gemma3", "tiny-gptoss", "tiny-llama4", "tiny-jamba")


@dataclass(frozen=True)
class DemoConfig:
    """The demo workload and engine sizes."""

    model: str = "tiny-gemma3"
    requests: int = 24
    turns: int = 3
    system_tokens: int = 64
    user_tokens: tuple[int, int] = (8, 24)
    answer_tokens: int = 16
    block_size: int = 16
    num_blocks: int = 160
    max_requests: int = 8
    token_budget: int = 64
    max_model_len: int = 256
    seed: int = 0
    window_aware_eviction: bool = False


def build_engine(cfg: DemoConfig) -> Engine:
    """The tiny model (random weights from ``seed``) and its engine."""
    if cfg.model not in TINY_MODELS:
        raise ValueError(f"unknown demo model {cfg.model!r}; choose one of {', '.join(TINY_MODELS)}")
    _, config = resolve_model(cfg.model)
    model = TinyLM(TinyConfig.from_hf(config), nnx.Rngs(cfg.seed))
    return Engine(model, num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_requests=cfg.max_requests,
                  max_model_len=cfg.max_model_len, token_budget=cfg.token_budget, seed=cfg.seed,
                  # One step program: a tiny model's decode steps gain little from their own, and each
                  # program costs tens of seconds to compile on a CPU.
                  token_buckets=(cfg.token_budget,),
                  window_aware_eviction=cfg.window_aware_eviction)


def _bar(done: int, total: int, extra: str) -> None:
    width = 30
    fill = width * done // max(total, 1)
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests {extra}", end="",
          file=sys.stderr, flush=True)


def _all_full_attention(layers):
    """The comparison model: every layer full attention (a Mamba layer counted as the model's first
    attention layer, since it has no KV of its own to measure)."""
    attn = next(l for l in layers if not isinstance(l, MambaSpec))
    return [replace(attn, name=l.name) if isinstance(l, MambaSpec) else l for l in layers]


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the workload; returns the summary figures."""
    if cfg.requests < 1 or cfg.turns < 1:
        raise ValueError("--requests and turns must be positive")
    engine = build_engine(cfg)
    rng = np.random.default_rng(cfg.seed)
    vocab = engine.vocab_size
    system = list(rng.integers(0, vocab, cfg.system_tokens))
    conversations = cdiv(cfg.requests, cfg.turns)
    turns_left = [min(cfg.turns, cfg.requests - c * cfg.turns) for c in range(conversations)]
    user = lambda: list(rng.integers(0, vocab, int(rng.integers(*cfg.user_tokens))))
    owner: dict[int, int] = {}
    for c in range(conversations):
        owner[engine.add_request(system + user(), cfg.answer_tokens)] = c
        turns_left[c] -= 1

    naive = plan(_all_full_attention(engine.model_layers), block_size=cfg.block_size, policy="naive",
                 num_blocks=2)
    peak_blocks = [0] * engine.layout.num_groups
    peak_ours = peak_naive = 0
    start = time.perf_counter()
    while engine.has_work:
        for rid, _ in engine.step():
            r = engine.requests[rid]
            c = owner[rid]
            if r.done and turns_left[c] > 0:  # the follow-up turn
                nxt = r.prompt + r.generated + user()
                if len(nxt) + cfg.answer_tokens <= cfg.max_model_len:
                    owner[engine.add_request(nxt, cfg.answer_tokens)] = c
                turns_left[c] -= 1
        if engine.stats.steps % 4 == 0:  # memory sample (a monitoring read, not part of the step)
            used = engine.blocks_in_use()
            peak_blocks = [max(a, b) for a, b in zip(peak_blocks, used)]
            peak_ours = max(peak_ours, sum(used) * engine.config.bytes_per_block)
            live = [r.total for r in engine.requests.values() if r.slot >= 0]
            peak_naive = max(peak_naive, sum(cdiv(t, cfg.block_size) for t in live) * naive.bytes_per_block)
        if progress:
            s = engine.stats
            _bar(sum(r.done for r in engine.requests.values()), cfg.requests,
                 f"{s.generated / max(time.perf_counter() - start, 1e-9):6.1f} tok/s")
    if progress:
        print(file=sys.stderr)
    elapsed = time.perf_counter() - start
    s = engine.stats
    return {
        "model": cfg.model, "requests": len(engine.requests), "steps": s.steps, "seconds": round(elapsed, 2),
        "generated_tokens": s.generated, "computed_tokens": s.tokens_computed,
        "tokens_per_s": round((s.generated) / elapsed, 1),
        "computed_tokens_per_s": round(s.tokens_computed / elapsed, 1),
        "steps_per_s": round(s.steps / elapsed, 2),
        "prefix_cache_hit_rate": round(s.cache_hit_tokens / max(s.prompt_tokens, 1), 3),
        "preemptions": s.preemptions, "compilations": engine.compilations(),
        "host_to_device_bytes_per_step": round(s.host_to_device_bytes / max(s.steps, 1)),
        "device_to_host_reads_per_step": s.device_to_host / max(s.steps, 1),
        "prepare_calls": s.prepare_calls,
        "groups": [f"{g.spec.kind}({len(g.layer_names)})" for g in engine.config.groups],
        "peak_blocks_per_group": peak_blocks,
        "peak_kv_bytes": peak_ours, "naive_full_attention_kv_bytes": peak_naive,
    }


def format_summary(summary: dict) -> str:
    """The summary as a few human-readable lines."""
    s = summary
    kib = lambda b: f"{b / 1024:.1f} KiB"
    return "\n".join([
        f"model {s['model']}: {s['requests']} requests, {s['steps']} steps in {s['seconds']} s "
        f"({s['compilations']} compilation(s) of the step)",
        f"throughput: {s['tokens_per_s']} generated tok/s, {s['computed_tokens_per_s']} computed tok/s, "
        f"{s['steps_per_s']} steps/s",
        f"prefix cache: {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens hit; "
        f"{s['preemptions']} preemptions",
        f"per step: {s['host_to_device_bytes_per_step']} bytes host->device (plan, releases, new prompts), "
        f"{s['device_to_host_reads_per_step']:.0f} read back; {s['prepare_calls']} steps released or admitted",
        "peak blocks in use per group: " + ", ".join(
            f"{g}: {n}" for g, n in zip(s["groups"], s["peak_blocks_per_group"])),
        f"peak KV memory: {kib(s['peak_kv_bytes'])} (hybrid pool) vs {kib(s['naive_full_attention_kv_bytes'])} "
        f"for an all-full-attention cache",
    ])


def main_demo(cfg: DemoConfig, as_json: bool = False) -> int:
    """Run and print (``hkv demo``)."""
    summary = run_demo(cfg)
    print(json.dumps(summary, indent=1) if as_json else format_summary(summary))
    return 0
