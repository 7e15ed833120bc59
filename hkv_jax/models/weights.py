"""Pretrained Gemma 3 weights into a ``Gemma3LM``: a Hugging Face directory or a llama.cpp GGUF file.

Both readers return ``(config dict, {Hugging Face tensor name: float32 array})``
in Hugging Face's conventions (``[out, in]`` projections, zero-centred norm
weights); ``build_gemma3`` puts them into the module by name. A GGUF file
differs in three ways, which ``read_gguf`` undoes:

- tensor names (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``);
- quantized tensors (Q8_0, Q5_0, Q4_K, Q6_K, ...), read by
  ``hkv_jax.models.gguf_file`` and dequantized with the ``gguf`` package;
- norm weights stored as ``1 + w``.

A GGUF also lacks config fields Gemma 3 needs; ``read_gguf`` supplies Gemma 3's
values: the local rope base (10000), every 6th layer full attention,
``query_pre_attn_scalar`` = head size, gelu-tanh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv_jax.models.gemma3 import Gemma3Config, Gemma3LM
from hkv_jax.models.gguf_file import GGUFFile
from hkv_jax.models.quant import check_quantize, quantize_model

# GGUF per-layer tensor name -> Hugging Face name after ``model.layers.{i}.``.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
# Gemma 3 facts a GGUF does not record.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, unit="tensor", leave=False)


def _gguf_hf_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor ``name``; ``ValueError`` if it is not a Gemma 3 tensor."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a Gemma 3 text model")


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The Hugging Face ``gemma3_text`` config dict of a Gemma 3 GGUF file (metadata only, fast)."""
    return _config_from_metadata(GGUFFile(path).metadata)


def _config_from_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"GGUF architecture is {arch!r}; only gemma3 is supported")
    n = int(meta["gemma3.block_count"])
    head_dim = int(meta["gemma3.attention.key_length"])
    return {
        "model_type": "gemma3_text", "torch_dtype": "float32",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": int(meta["gemma3.embedding_length"]),
        "intermediate_size": int(meta["gemma3.feed_forward_length"]),
        "num_hidden_layers": n,
        "num_attention_heads": int(meta["gemma3.attention.head_count"]),
        "num_key_value_heads": int(meta["gemma3.attention.head_count_kv"]),
        "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(n)],
        "rope_theta": float(meta.get("gemma3.rope.freq_base", 1e6)),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "rms_norm_eps": float(meta.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get("gemma3.context_length", 32768)),
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": int(meta.get("tokenizer.ggml.eos_token_id", 1)),
    }


def read_gguf(path: str | Path, *, progress: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config, weights)`` of a Gemma 3 GGUF file, in Hugging Face's names and conventions, float32."""
    f = GGUFFile(path)
    config = _config_from_metadata(f.metadata)
    weights = {}
    for info in _progress(f.tensors, "dequantizing", progress):
        name = _gguf_hf_name(info.name)
        w = f.array(info)
        weights[name] = w - 1.0 if name.endswith("norm.weight") else w
    return config, weights


def read_hf_dir(path: str | Path, *, progress: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config, weights)`` of a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``)."""
    from safetensors.numpy import load_file

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root}: no config.json")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    weights = {}
    for f in _progress(files, "loading", progress):
        for name, w in load_file(str(f)).items():
            weights[name] = w.astype(np.float32) if w.dtype != np.float32 else w
    return json.loads((root / "config.json").read_text()), weights


def _param_name(path: tuple) -> tuple[str, bool]:
    """(Hugging Face name, transposed?) of the module parameter at ``path``."""
    *module, leaf = (str(p) for p in path)
    return "model." + ".".join(module) + ".weight", leaf == "kernel"


def build_gemma3(cfg: Gemma3Config, weights: Mapping[str, np.ndarray]) -> Gemma3LM:
    """A ``Gemma3LM`` holding ``weights`` (Hugging Face names; ``lm_head.weight``, tied, is ignored).

    Raises ``ValueError`` naming missing, unexpected or mis-shaped tensors."""
    abstract = nnx.eval_shape(lambda: Gemma3LM(cfg, nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)  # rest: the key centres, zeros until calibrated
    pure = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    used, filled, problems = set(), [], []
    for path, leaf in leaves:
        name, transpose = _param_name(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path))
        w = weights.get(name)
        if w is None:
            problems.append(f"missing {name}")
            filled.append(None)
            continue
        used.add(name)
        w = np.asarray(w).T if transpose else np.asarray(w)
        if w.shape != leaf.shape:
            problems.append(f"{name}: shape {list(w.shape)}, expected {list(leaf.shape)}")
        filled.append(jnp.asarray(w, leaf.dtype))
    extra = sorted(set(weights) - used - {"lm_head.weight"})
    if extra:
        problems.append("unexpected " + ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""))
    if problems:
        raise ValueError("weights do not fit the Gemma 3 config: " + "; ".join(problems[:8]))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, filled))
    return nnx.merge(graphdef, state, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest))


def load_gemma3(path: str | Path, *, kv_dtype: str = "float32", param_dtype: str = "float32",
                quantize: str | None = None, progress: bool = True) -> Gemma3LM:
    """A Gemma 3 model from a ``.gguf`` file or a Hugging Face directory (KV cache in ``kv_dtype``).

    ``quantize="int8"``: int8 linear layers and output projection (``hkv_jax.models.quant``)."""
    path = Path(path)
    check_quantize(quantize)  # before the slow read
    if not path.exists():
        raise ValueError(f"no such model file or directory: {path}")
    config, weights = read_gguf(path, progress=progress) if path.suffix == ".gguf" else read_hf_dir(
        path, progress=progress)
    model = build_gemma3(Gemma3Config.from_hf(config, kv_dtype=kv_dtype, param_dtype=param_dtype), weights)
    return model if quantize is None else quantize_model(model, quantize)
