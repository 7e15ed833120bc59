"""``hkv demo``: serve a multi-turn chat on a hybrid model and report.

Conversations share one system prompt; each turn's prompt is the previous
turn's prompt + answer + a new user message, and is submitted when the
previous turn finishes, so later turns find their history in the prefix
cache. Prints a progress bar, then tokens/s, steps/s, the prefix-cache hit
rate, blocks in use per KV cache group (peak) and the memory an all-full-
attention cache would have needed at the same peak.

Models: the real Gemma 3 270M (``gemma-3-270m``, the default when the
``gemma`` extra is installed) works in text. That checkpoint is the base model
(no chat template), so it continues a cooking school's question-and-answer
sheet, one question a turn, each answer ending at its line's end; a model with
a chat template chats in Gemma's turn format, each answer ending at
``<end_of_turn>``. A tiny random model (``tiny-gemma3`` ..., offline, the
default otherwise) gets random token ids.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from hkv_jax.engine import SamplingParams
from hkv_jax.engine.factory import ServeConfig, build_engine
from hkv_jax.planner import cdiv, plan

SYSTEM = ("You are a concise assistant for a cooking school. Answer in one or two sentences, "
          "plainly, without lists.")
QUESTIONS = (
    "How long should I boil an egg for a soft yolk?", "Why does bread dough need to rest?",
    "What is the difference between baking soda and baking powder?", "How do I keep rice from sticking?",
    "Which oil is best for frying at high heat?", "Why do onions make you cry?",
    "How can I tell when pasta is done?", "What does it mean to fold egg whites?",
    "Can I freeze fresh herbs?", "Why should meat rest after cooking?",
    "What makes a sauce thicken?", "How do I sharpen a kitchen knife safely?",
)
_USER_TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
# A base model (no chat template) continues documents, not turns: its conversations are one question-and-answer
# sheet that every conversation shares the head of, each answer ending at its line's end.
SHEET = ("Cooking school: questions from students, each answered by the chef in one or two sentences.\n\n"
         "Q: How do I know when the oil is hot enough for frying?\n"
         "A: Drop in a cube of bread; when it browns in about a minute, the oil is ready.\n\n"
         "Q: Why do my cookies spread so much in the oven?\n"
         "A: The butter was too soft or the dough too warm; chill the dough for half an hour before baking.\n\n"
         "Q: Should I salt pasta water?\n"
         "A: Yes, generously, because the pasta absorbs the salt as it cooks and tastes flat without it.\n\n")
_QUESTION = "Q: {}\nA:"


@dataclass(frozen=True)
class DemoConfig(ServeConfig):
    """The demo's workload, and the model and engine (``ServeConfig``'s fields) it runs on."""

    requests: int = 24
    turns: int = 3
    system_tokens: int = 64
    user_tokens: tuple[int, int] = (8, 24)
    answer_tokens: int | None = None   # default: 16 for a tiny model, 32 for a real one


def _bar(done: int, total: int, extra: str) -> None:
    width = 30
    fill = width * done // max(total, 1)
    print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests {extra}", end="",
          file=sys.stderr, flush=True)


def _all_full_attention(layers):
    """The comparison model: every layer full attention (a Mamba layer counted as the model's first
    attention layer, since it has no KV of its own to measure)."""
    attn = next(l for l in layers if not l.recurrent)
    return [replace(attn, name=l.name) if l.recurrent else l for l in layers]


class _Chat:
    """The workload's prompts: random ids for a tiny model. For a real one, text: in Gemma's turn format with
    the system prompt at the head of the first user turn when the model has a chat template; else (a base
    model) a question-and-answer sheet (``SHEET``) that each conversation continues, one question a turn,
    each answer stopping at its line's end. Either way every conversation shares the head (prefix cache
    hits), and each turn's prompt holds the turns before it. Each turn's message comes from its own seed
    (conversation, turn), so the workload is the same whatever order requests finish in (runs of two
    engines compare)."""

    def __init__(self, cfg: DemoConfig, vocab: int, codec):
        self.cfg, self.vocab, self.codec = cfg, vocab, codec
        self.chat = codec is not None and codec.chat_template is not None
        rng = np.random.default_rng(cfg.seed)
        if codec is None:
            self.stop, self.system = (), list(rng.integers(0, vocab, cfg.system_tokens))
        elif self.chat:
            self.stop, self.system = codec.eos_ids, codec.encode("<start_of_turn>user\n" + SYSTEM + "\n\n")
        else:  # an answer ends with its line (a token holding a line break ends it)
            breaks = {i for text in ("\n", "\n\n") for i in codec.encode(text, bos=False)}
            self.stop, self.system = (*codec.eos_ids, *sorted(breaks)), codec.encode(SHEET)

    def _message(self, conversation: int, turn: int) -> list[int] | str:
        """Turn ``turn``'s user message of ``conversation``: random ids (tiny model) or a question."""
        if self.codec is not None:  # a conversation asks each question at most once
            order = np.random.default_rng((self.cfg.seed, conversation)).permutation(len(QUESTIONS))
            return QUESTIONS[int(order[turn % len(QUESTIONS)])]
        rng = np.random.default_rng((self.cfg.seed, conversation, turn))
        return list(rng.integers(0, self.vocab, int(rng.integers(*self.cfg.user_tokens))))

    def first(self, conversation: int) -> list[int]:
        """A conversation's first prompt."""
        message = self._message(conversation, 0)
        if self.codec is None:
            return self.system + message
        text = message + "<end_of_turn>\n<start_of_turn>model\n" if self.chat else _QUESTION.format(message)
        return self.system + self.codec.encode(text, bos=False)

    def follow_up(self, r, conversation: int, turn: int) -> list[int]:
        """Turn ``turn`` of ``conversation`` after request ``r``: its prompt, its answer, a new user message."""
        message = self._message(conversation, turn)
        if self.codec is None:
            return r.prompt + r.generated + message
        ended = bool(r.generated) and r.generated[-1] in self.stop
        if self.chat:
            text = ("\n" if ended else "<end_of_turn>\n") + _USER_TURN.format(message)
        else:  # a blank line before the next question, whichever line break token ended the answer
            breaks = len(self.codec.decode(r.generated[-1:])) if ended else 0
            text = "\n" * max(2 - breaks, 0) + _QUESTION.format(message)
        return r.prompt + r.generated + self.codec.encode(text, bos=False)


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the workload; returns the summary figures."""
    if cfg.requests < 1 or cfg.turns < 1:
        raise ValueError("--requests and turns must be positive")
    engine, codec = build_engine(cfg)
    chat = _Chat(cfg, engine.vocab_size, codec)
    params = SamplingParams(max_new_tokens=cfg.answer_tokens or (32 if codec else 16), stop=chat.stop)
    answer = params.max_new_tokens
    last: dict[int, int] = {}  # conversation -> its latest request
    conversations = cdiv(cfg.requests, cfg.turns)
    turns_left = [min(cfg.turns, cfg.requests - c * cfg.turns) for c in range(conversations)]
    owner: dict[int, int] = {}
    for c in range(conversations):
        last[c] = engine.add_request(chat.first(c), params)
        owner[last[c]] = c
        turns_left[c] -= 1

    naive = plan(_all_full_attention(engine.model_layers), block_size=engine.config.block_size, policy="naive",
                 num_blocks=2)
    peak_blocks = [0] * engine.layout.num_groups
    peak_ours = peak_naive = 0
    start = time.perf_counter()
    while engine.has_work:
        for rid, _ in engine.step():
            r = engine.requests[rid]
            c = owner[rid]
            if r.done and turns_left[c] > 0:  # the follow-up turn
                nxt = chat.follow_up(r, c, min(cfg.turns, cfg.requests - c * cfg.turns) - turns_left[c])
                if len(nxt) + answer <= engine.layout.max_model_len:
                    last[c] = engine.add_request(nxt, params)
                    owner[last[c]] = c
                turns_left[c] -= 1
        if engine.stats.steps % 4 == 0:  # memory sample (a monitoring read, not part of the step)
            used = engine.blocks_in_use()
            peak_blocks = [max(a, b) for a, b in zip(peak_blocks, used)]
            peak_ours = max(peak_ours, sum(used) * engine.kv_cache_config.bytes_per_block)
            live = [r.total for r in engine.requests.values() if r.slot >= 0]
            peak_naive = max(peak_naive, sum(naive.blocks_per_request(t) for t in live) * naive.bytes_per_block)
        if progress:
            s = engine.stats
            _bar(sum(r.done for r in engine.requests.values()), cfg.requests,
                 f"{s.generated / max(time.perf_counter() - start, 1e-9):6.1f} tok/s")
    if progress:
        print(file=sys.stderr)
    elapsed = time.perf_counter() - start
    s = engine.stats
    host = engine.host_usage()
    sample = engine.requests[last[0]]
    done = list(engine.requests.values())
    ttft = [1e3 * (r.first_token_time - r.arrival_time) for r in done]
    tpot = [1e3 * (r.finished_time - r.first_token_time) / (len(r.generated) - 1) for r in done if len(r.generated) > 1]
    return {
        "model": cfg.model, "requests": len(engine.requests), "steps": s.steps, "seconds": round(elapsed, 2),
        "generated_tokens": s.generated, "computed_tokens": s.tokens_computed,
        "tokens_per_s": round((s.generated) / elapsed, 1),
        "computed_tokens_per_s": round(s.tokens_computed / elapsed, 1),
        "steps_per_s": round(s.steps / elapsed, 2),
        "prefix_cache_hit_rate": round(s.cache_hit_tokens / max(s.prompt_tokens, 1), 3),
        "preemptions": s.preemptions, "compilations": engine.compilations(),
        **({"host_hit_rate": round(host.hit_tokens / max(s.prompt_tokens, 1), 3),
            "host_bytes_down": host.bytes_down, "host_bytes_up": host.bytes_up,
            "host_used_bytes": host.used_bytes, "host_bytes": host.capacity_bytes} if host else {}),
        **({"spec_draft_tokens": s.spec_draft_tokens, "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_acceptance_rate": round(s.acceptance_rate, 3),
            "spec_mean_accepted_length": round(s.spec_accepted_tokens / max(s.spec_drafts, 1), 2)}
           if engine.config.speculative else {}),
        # Per request, from its own times (Request.arrival_time ...): the first ones include compiling.
        "ttft_ms_median": round(float(np.median(ttft)), 1), "ttft_ms_p90": round(float(np.percentile(ttft, 90)), 1),
        "tpot_ms_median": round(float(np.median(tpot)), 1) if tpot else None,
        "host_to_device_bytes_per_step": round(s.host_to_device_bytes / max(s.steps, 1)),
        "device_to_host_reads_per_step": s.device_to_host / max(s.steps, 1),
        "prepare_calls": s.prepare_calls,
        "groups": [f"{g.spec.kind}({len(g.layer_names)})" for g in engine.kv_cache_config.groups],
        "peak_blocks_per_group": peak_blocks,
        "peak_kv_bytes": peak_ours, "naive_full_attention_kv_bytes": peak_naive,
        **({"sample_dialogue": codec.tokenizer.decode(sample.prompt + sample.generated)} if codec else {}),
    }


def format_summary(summary: dict) -> str:
    """The summary as a few human-readable lines."""
    s = summary
    def kib(b):
        return f"{b / 1024:.1f} KiB"
    return "\n".join([
        f"model {s['model']}: {s['requests']} requests, {s['steps']} steps in {s['seconds']} s "
        f"({s['compilations']} compilation(s) of the step)",
        f"throughput: {s['tokens_per_s']} generated tok/s, {s['computed_tokens_per_s']} computed tok/s, "
        f"{s['steps_per_s']} steps/s",
        f"prefix cache: {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens hit; "
        f"{s['preemptions']} preemptions",
    ] + ([f"host tier: {100 * s['host_hit_rate']:.1f}% of prompt tokens hit blocks from it; "
          f"{kib(s['host_used_bytes'])} of {kib(s['host_bytes'])} used; {kib(s['host_bytes_down'])} copied down, "
          f"{kib(s['host_bytes_up'])} up"] if "host_hit_rate" in s else [])
      + ([f"speculative decoding: {100 * s['spec_acceptance_rate']:.1f}% of {s['spec_draft_tokens']} draft tokens "
          f"accepted, {s['spec_mean_accepted_length']} per draft"] if "spec_acceptance_rate" in s else []) + [
        f"latency per request: time to first token {s['ttft_ms_median']} ms median, {s['ttft_ms_p90']} ms p90 "
        f"(the first ones include compiling); time per output token {s['tpot_ms_median']} ms median",
        f"per step: {s['host_to_device_bytes_per_step']} bytes host->device (plan, releases, new prompts), "
        f"{s['device_to_host_reads_per_step']:.0f} read back; {s['prepare_calls']} steps released or admitted",
        "peak blocks in use per group: " + ", ".join(
            f"{g}: {n}" for g, n in zip(s["groups"], s["peak_blocks_per_group"])),
        f"peak KV memory: {kib(s['peak_kv_bytes'])} (hybrid pool) vs {kib(s['naive_full_attention_kv_bytes'])} "
        f"for an all-full-attention cache",
    ] + ([f"conversation 0, as served:\n{s['sample_dialogue']}"] if "sample_dialogue" in s else []))


def main_demo(cfg: DemoConfig, as_json: bool = False) -> int:
    """Run and print (``hkv demo``)."""
    summary = run_demo(cfg)
    print(json.dumps(summary, indent=1) if as_json else format_summary(summary))
    return 0
