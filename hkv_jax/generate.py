"""``hkv generate``: stream one real model's greedy (or sampled) continuation of a prompt.

Loads the model (progress bar), sizes a one-request engine for the prompt plus
``max_new_tokens``, shows the chunked prefill's progress, then prints the text
as it is generated, stopping at the model's end-of-turn / EOS tokens or at a
stop string (left out of the text, as vLLM does).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from hkv_jax.engine import Engine, EngineConfig, SamplingParams
from hkv_jax.engine.factory import SERVE_DEFAULTS, check_engine_fields, engine_config, engine_for
from hkv_jax.engine.sampling_params import KNOBS
from hkv_jax.models.pretrained import load_pretrained
from hkv_jax.models.tokenizer import gemma_chat

# ``hkv generate``'s engine fields unless ``GenerateConfig.engine`` gives them: ``hkv serve``'s decoding
# (``SERVE_DEFAULTS``), and 256-token prefill chunks (one request, so a long prompt takes fewer steps).
GENERATE_DEFAULTS = {**SERVE_DEFAULTS, "token_budget": 256}


@dataclass(frozen=True)
class GenerateConfig:
    """What ``hkv generate`` runs. ``engine``: ``EngineConfig`` fields (``GENERATE_DEFAULTS`` for those left
    out; the pool holds the one request, of the prompt plus ``max_new_tokens`` rounded up to whole blocks)."""

    model: str = "gemma-3-270m"
    max_new_tokens: int = 64
    chat: bool = True
    # Sampling values by ``KNOBS`` name (``SamplingParams``' fields: temperature, top_p, ...); those left out
    # are greedy and uncut, with no penalty.
    sampling: dict = field(default_factory=dict)
    stop: tuple[str, ...] = ()    # stop strings
    quantize: str | None = None   # "int8": int8 weights (hkv_jax.models.quant)
    engine: dict = field(default_factory=dict)

    def __post_init__(self):
        check_engine_fields(self.engine)

    def params(self, eos_ids=()) -> SamplingParams:
        """The request's ``SamplingParams`` (``ValueError`` for a value out of range or an unknown name)."""
        unknown = set(self.sampling) - {k.name for k in KNOBS}
        if unknown:
            raise ValueError(f"sampling: unknown {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(k.name for k in KNOBS)}")
        return SamplingParams(max_new_tokens=self.max_new_tokens, stop=tuple(eos_ids), stop_strings=self.stop,
                              **self.sampling)


def generate(cfg: GenerateConfig, prompt: str, out: TextIO = sys.stdout, progress: bool = True) -> dict:
    """Stream the continuation of ``prompt`` to ``out``; returns ids, text and timings.

    ``decode_tokens_per_s`` counts the steps after the first token that compiled nothing; the ones that
    compiled a program (the decode step's own bucket, the first time) are ``decode_compile_seconds``."""
    cfg.params()  # checked before the model loads
    t0 = time.perf_counter()
    model, codec = load_pretrained(cfg.model, quantize=cfg.quantize, progress=progress)
    ids = codec.encode(gemma_chat([{"role": "user", "content": prompt}]) if cfg.chat else prompt)
    fields = {**GENERATE_DEFAULTS, **cfg.engine, "max_requests": 1}
    # Whole blocks: the engine takes no request shorter than one, and prompts of about the same length
    # then share their compiled programs (the persistent compilation cache keys them by max_model_len).
    block = fields.get("block_size", EngineConfig.block_size)
    config = engine_config(model, **fields, max_model_len=-(-(len(ids) + cfg.max_new_tokens) // block) * block)
    engine = engine_for(model, codec, config, detokenize=codec.decode)
    rid = engine.add_request(ids, cfg.params(codec.eos_ids))
    load_s = time.perf_counter() - t0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ids), desc="prefill (first steps compile)", unit="tok", leave=False)
    shown, t_first = "", None
    decode_s, decode_tokens, compile_s = 0.0, 0, 0.0  # decode steps after the first token
    while engine.has_work:
        compiled, t_step = Engine.compilations(), time.perf_counter()
        events = engine.step()
        req = engine.requests[rid]  # read after each step: the engine books decode tokens lazily
        if t_first is not None:  # a step that compiled a program is not a decode figure
            step_s = time.perf_counter() - t_step
            if Engine.compilations() == compiled:
                decode_s, decode_tokens = decode_s + step_s, decode_tokens + len(events)
            else:
                compile_s += step_s
        if bar is not None:
            bar.update(min(req.computed, len(ids)) - bar.n)
        if events:
            if t_first is None:
                t_first = time.perf_counter()
                if bar is not None:
                    bar.close()
                    bar = None
            text = engine.text(rid, stable=True)
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = engine.text(rid)
    out.write(text[len(shown):] + "\n")
    done = time.perf_counter()
    return {"prompt_tokens": len(ids), "generated": req.generated, "text": text,
            "finish_reason": req.finish_reason,
            "load_seconds": round(load_s, 2), "seconds_to_first_token": round((t_first or done) - t0 - load_s, 2),
            "decode_compile_seconds": round(compile_s, 2),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None}
