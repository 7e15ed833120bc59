"""Layer specs from a Hugging Face ``config.json`` dict.

Reads the fields real configs use to say which layer is which:
``layer_types``, ``layers_block_type``, ``attn_layer_period`` /
``attn_layer_offset`` (Jamba), ``full_attention_interval`` (Qwen3-Next),
``sliding_window_pattern`` (Gemma 3), ``attention_chunk_size`` +
``no_rope_layers`` (Llama 4), Gemma 2's alternation, a plain
``sliding_window`` (Mistral), ``num_kv_shared_layers`` (Gemma 3n), and the
Mamba-1, Mamba-2 and Gated-DeltaNet state fields. Gemma 4's full-attention layers
have their own KV shape: ``global_head_dim`` and ``num_global_key_value_heads``
(absent: the sliding layers' ``head_dim`` and ``num_key_value_heads``);
``attention_k_eq_v`` (keys used as values) is checked but changes no page: vLLM
stores both K and V, and so does the cache here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hkv_jax.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVSharingSpec,
    LayerSpec,
    MambaSpec,
    SlidingWindowSpec,
    dtype_bytes,
)

# Normalised kinds of one layer.
FULL, SLIDING, CHUNKED, RECURRENT = "full", "sliding_window", "chunked_local", "mamba"

_LAYER_TYPE_NAMES = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local_sliding": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": RECURRENT,
    "mamba": RECURRENT,
    "mamba2": RECURRENT,
}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a (possibly multimodal) config, top-level dtype inherited."""
    if not isinstance(config, dict):
        raise ValueError("a model config must be a JSON object")
    inner = config.get("text_config")
    if isinstance(inner, dict):
        merged = dict(inner)
        for key in ("torch_dtype", "dtype", "model_type"):
            if key in config and key not in merged:
                merged[key] = config[key]
        return merged
    return config


def _require_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive int, got {value!r}")
    return value


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """The kind of every layer (``full``, ``sliding_window``, ``chunked_local``, ``mamba``)."""
    n = _require_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        try:
            return [_LAYER_TYPE_NAMES[t] for t in types]
        except KeyError as e:
            raise ValueError(f"unknown layer type {e.args[0]!r} in layer_types") from None
    if "attn_layer_period" in cfg:
        period, offset = cfg["attn_layer_period"], cfg.get("attn_layer_offset", 0)
        return [FULL if i % period == offset else RECURRENT for i in range(n)]
    if "full_attention_interval" in cfg:
        k = cfg["full_attention_interval"]
        return [FULL if (i + 1) % k == 0 else RECURRENT for i in range(n)]
    if cfg.get("attention_chunk_size"):
        # Llama 4: no_rope_layers[i] == 1 means RoPE + chunked local; 0 means global NoPE.
        rope = cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
        if len(rope) != n:
            raise ValueError(f"no_rope_layers has {len(rope)} entries for {n} layers")
        return [CHUNKED if r else FULL for r in rope]
    if cfg.get("sliding_window_pattern"):
        k = cfg["sliding_window_pattern"]
        return [FULL if (i + 1) % k == 0 else SLIDING for i in range(n)]
    if cfg.get("model_type") == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return [SLIDING] * n
    return [FULL] * n


# ``--kv-cache-dtype``'s names (vLLM's): the attention layers' KV cache dtype; a Mamba state keeps its own.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def with_kv_cache_dtype(layers: tuple[LayerSpec, ...], kv_cache_dtype: str) -> tuple[LayerSpec, ...]:
    """``layers`` with the attention layers' KV dtype set to ``kv_cache_dtype`` (a ``KV_CACHE_DTYPES`` name;
    ``"auto"``: unchanged); Mamba states keep theirs. ``ValueError`` for an unknown name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return tuple(replace(l, dtype=dtype) if dtype and hasattr(l, "dtype") else l for l in layers)


def kv_dtype(cfg: dict[str, Any], override: str | None = None) -> str:
    """The KV cache dtype: ``override``, else the model dtype with float32 served as bfloat16.

    vLLM's ``dtype="auto"`` also serves float32 checkpoints in half precision.
    """
    if override is not None:
        dtype_bytes(override)
        return override
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return "bfloat16" if dt == "float32" else dt


def mamba_state(cfg: dict[str, Any], dtype: str) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """Shapes and dtypes of one recurrent layer's state (conv state, SSM state)."""
    if "linear_num_value_heads" in cfg:  # Gated DeltaNet (Qwen3-Next)
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        shapes = ((cfg["linear_conv_kernel_dim"] - 1, conv_dim), (nv, dk, dv))
    elif "mamba_n_heads" in cfg:  # Mamba-2 (Granite 4.0-H, Bamba, ...)
        heads, head_dim = cfg["mamba_n_heads"], cfg["mamba_d_head"]
        d_state, groups = cfg["mamba_d_state"], cfg.get("mamba_n_groups", 1)
        conv_dim = heads * head_dim + 2 * groups * d_state
        shapes = ((cfg["mamba_d_conv"] - 1, conv_dim), (heads, head_dim, d_state))
    elif "mamba_d_state" in cfg:  # Mamba-1 (Jamba)
        inner = cfg.get("mamba_expand", 2) * _require_int(cfg, "hidden_size")
        shapes = ((cfg["mamba_d_conv"] - 1, inner), (inner, cfg["mamba_d_state"]))
    else:
        raise ValueError("config has recurrent layers but no Mamba or linear-attention state fields")
    return shapes, (dtype,) * len(shapes)


def layers_from_hf_config(
    config: dict[str, Any], *, dtype: str | None = None, kv_cache_dtype: str = "auto",
    name_format: str = "model.layers.{i}",
) -> tuple[LayerSpec, ...]:
    """Layer specs for a Hugging Face ``config.json`` dict (model order).

    ``dtype`` overrides the cache dtype of every layer (attention KV and Mamba states); ``kv_cache_dtype``
    (a ``KV_CACHE_DTYPES`` name, ``"auto"``: as ``dtype``) that of the attention layers only, as vLLM's
    ``--kv-cache-dtype``: a Mamba state stays in its own dtype. Raises ``ValueError`` for configs that lack
    the needed fields or an unknown ``kv_cache_dtype``.
    """
    cfg = text_config(config)
    kinds = layer_kinds(cfg)
    n = len(kinds)
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if any(k != RECURRENT for k in kinds):
        if not heads:
            raise ValueError("config needs num_key_value_heads or num_attention_heads")
        head_size = cfg.get("head_dim") or _require_int(cfg, "hidden_size") // _require_int(cfg, "num_attention_heads")
    if not isinstance(cfg.get("attention_k_eq_v", False), bool):
        raise ValueError(f"config field 'attention_k_eq_v' must be true or false, got {cfg['attention_k_eq_v']!r}")
    if any(k == FULL for k in kinds):  # Gemma 4: the full-attention layers' own KV shape
        full_heads = cfg.get("num_global_key_value_heads") or heads
        full_head_size = cfg.get("global_head_dim") or head_size
    kvd = kv_dtype(cfg, dtype)
    names = [name_format.format(i=i) for i in range(n)]
    state = mamba_state(cfg, kvd) if RECURRENT in kinds else None

    shared_from = n - int(cfg.get("num_kv_shared_layers") or 0)
    if not 0 < shared_from <= n:
        raise ValueError(f"num_kv_shared_layers must be below num_hidden_layers ({n})")
    layers: list[LayerSpec] = []
    for i, kind in enumerate(kinds):
        name = names[i]
        if i >= shared_from:
            # Gemma 3n: a shared layer reads the last non-shared layer of its own kind.
            target = max((j for j in range(shared_from) if kinds[j] == kind), default=None)
            if target is None:
                raise ValueError(f"layer {name!r}: no earlier {kind} layer to share KV with")
            layers.append(KVSharingSpec(name=name, target=names[target]))
        elif kind == RECURRENT:
            layers.append(MambaSpec(name=name, shapes=state[0], dtypes=state[1]))
        else:
            common = dict(name=name, num_kv_heads=heads, head_size=head_size, dtype=kvd)
            if kind == SLIDING:
                layers.append(SlidingWindowSpec(sliding_window=_require_int(cfg, "sliding_window"), **common))
            elif kind == CHUNKED:
                layers.append(
                    ChunkedLocalSpec(attention_chunk_size=_require_int(cfg, "attention_chunk_size"), **common)
                )
            else:
                layers.append(FullAttentionSpec(**{**common, "num_kv_heads": full_heads, "head_size": full_head_size}))
    return with_kv_cache_dtype(tuple(layers), kv_cache_dtype)
