"""Gemma 3 text decoder in Flax NNX (the architecture of Hugging Face's ``Gemma3ForCausalLM``).

Per layer: RMSNorm (Gemma's ``x * (1 + w)``, in float32) before and after
attention and before and after the gated-GELU (tanh) MLP; attention with
per-head RMSNorm on queries and keys, rotary embeddings with a local base on
sliding-window layers and a global base on full-attention layers, and scores
scaled by ``query_pre_attn_scalar ** -0.5``. Embeddings are scaled by
``sqrt(hidden_size)`` and tied to the output projection.

Module names follow the Hugging Face checkpoint (``layers[i].self_attn.q_proj``
...), so ``hkv_jax.models.weights`` maps a checkpoint onto the module name by
name. Two forward passes, as ``TinyLM``: ``dense`` (uncached, the oracle) and
``paged`` (the engine's protocol).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.attention import AttentionMetadata, attention, pad_rows
from hkv_jax.cache import KVCache
from hkv_jax.models.hf_config import layers_from_hf_config, text_config
from hkv_jax.models.key_centre import KeyCentre, keys_to_write, shift_invariant
from hkv_jax.models.layers import (
    Heads,
    Linear,
    RMSNorm,
    capped,
    dense_attention,
    gate_and_up,
    gemm_rows,
    projected_heads,
    rope,
    take_heads,
    two_rows_at_least,
)
from hkv_jax.spec import LayerSpec
from kernels_pallas.key_finish import KeyFinish, rope_frequencies
from kernels_pallas.reference import is_fp8


@dataclass(frozen=True)
class Gemma3Config:
    """Shapes and options of a Gemma 3 text decoder (hashable: usable as a jit static argument)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    rope_theta: float = 1_000_000.0        # full-attention layers
    rope_local_theta: float = 10_000.0     # sliding-window layers
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    param_dtype: str = "float32"

    @classmethod
    def from_hf(cls, config: dict[str, Any], *, kv_dtype: str | None = None,
                param_dtype: str = "float32") -> "Gemma3Config":
        """The decoder a Hugging Face ``gemma3_text`` (or ``gemma3``) config dict describes.

        ``kv_dtype`` overrides the KV cache dtype (default: the config's ``torch_dtype``)."""
        cfg = text_config(config)
        if not str(cfg.get("model_type", "")).startswith("gemma3"):
            raise ValueError(f"not a Gemma 3 config (model_type {cfg.get('model_type')!r})")
        layers = layers_from_hf_config(config, dtype=kv_dtype)
        if not all(l.paged_kv for l in layers):
            raise ValueError("Gemma 3 layers are attention layers only")
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim, layers=tuple(layers),
            rope_theta=float(rope.get("full_attention", {}).get("rope_theta", cfg.get("rope_theta", 1e6))),
            rope_local_theta=float(rope.get("sliding_attention", {}).get(
                "rope_theta", cfg.get("rope_local_base_freq", 1e4))),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attn_soft_cap=cfg.get("attn_logit_softcapping"), final_soft_cap=cfg.get("final_logit_softcapping"),
            param_dtype=param_dtype)


def _linear(n_in: int, n_out: int, cfg: Gemma3Config, rngs: nnx.Rngs) -> Linear:
    return Linear(n_in, n_out, use_bias=False, param_dtype=cfg.param_dtype, dtype=cfg.param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """One attention layer; its KV lives in the cache under the layer spec's name."""

    def __init__(self, cfg: Gemma3Config, index: int, rngs: nnx.Rngs):
        spec = cfg.layers[index]
        self.cfg, self.name = cfg, spec.name
        self.window = spec.window
        self.theta = cfg.rope_local_theta if self.window is not None else cfg.rope_theta
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(h, cfg.num_heads * d, cfg, rngs)
        self.k_proj = _linear(h, cfg.num_kv_heads * d, cfg, rngs)
        self.v_proj = _linear(h, cfg.num_kv_heads * d, cfg, rngs)
        self.o_proj = _linear(cfg.num_heads * d, h, cfg, rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.param_dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.param_dtype)
        self.key_centre = (KeyCentre(jnp.zeros((cfg.num_kv_heads, d), jnp.float32))
                           if shift_invariant(cfg.attn_soft_cap, None) else None)

    def _qkv(self, x, positions) -> tuple[jax.Array, Heads, KeyFinish, Heads]:
        """Queries (normed, rotated), the raw keys and their finish (the K norm and RoPE, which the KV write
        applies: ``KeyFinish``), and where the values are (``layers.projected_heads``: on one device among all
        three projections' heads, which the KV write reads in place)."""
        cfg = self.cfg
        q, k, v = projected_heads((self.q_proj, self.k_proj, self.v_proj), x, cfg.head_dim)
        finish = KeyFinish(positions, self.k_norm.weight[...], rope_frequencies(cfg.head_dim, self.theta),
                           norm_offset=1.0, eps=self.k_norm.eps)
        return rope(self.q_norm(take_heads(q, cfg.num_heads)), positions, self.theta), k, finish, v

    def keys(self, x, positions) -> jax.Array:
        """The finished keys ``[T, Hkv, D]`` of inputs ``x: [T, hidden]`` at ``positions``."""
        _, k, finish, _ = self._qkv(x, positions)
        return finish.apply(take_heads(k, self.cfg.num_kv_heads))

    @property
    def rope_theta(self) -> float:
        """The RoPE base of this layer's keys (``key_centre.position_average``)."""
        return self.theta

    @property
    def scale(self) -> float:
        """The score scale, ``query_pre_attn_scalar ** -0.5``."""
        return self.cfg.query_pre_attn_scalar ** -0.5

    def dense(self, x):
        """Causal attention over one whole sequence, uncached."""
        q, k, finish, v = self._qkv(x, jnp.arange(x.shape[0]))
        k, v = finish.apply(take_heads(k, self.cfg.num_kv_heads)), take_heads(v, self.cfg.num_kv_heads)
        out = dense_attention(q, k, v, window=self.window, chunk=None,
                              soft_cap=self.cfg.attn_soft_cap, sinks=None, scale=self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def paged(self, x, positions, cache: KVCache, metadata: AttentionMetadata, impl: str):
        """A ragged batch through the paged cache: KV write, then attention."""
        q, k, finish, (values, v_head) = self._qkv(x, positions)
        dt = jnp.dtype(cache.layout.slot(self.name).spec.dtype)
        k, k_head, finish = keys_to_write(k, finish, self.cfg.num_kv_heads, self.key_centre, dt)
        # Over bfloat16/float32 pages the attention runs in the pages' dtype; over fp8 pages in the model's:
        # the KV write rounds K/V (saturating), the kernels read the pages up to the queries' dtype, and the
        # queries and the output are not rounded. The raw keys keep the model's dtype: the write rounds them
        # once finished.
        dt = x.dtype if is_fp8(dt) else dt
        out, cache = attention(self.name, q.astype(dt), k, values.astype(dt), cache, metadata, k_head=k_head,
                               k_finish=finish, v_head=v_head, sm_scale=self.scale,
                               soft_cap=self.cfg.attn_soft_cap, impl=impl)
        return self.o_proj(out.astype(x.dtype).reshape(x.shape[0], -1)), cache


class MLP(nnx.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` (gate and up: ``layers.gate_and_up``)."""

    def __init__(self, cfg: Gemma3Config, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, cfg, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, cfg, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, cfg, rngs)

    def __call__(self, x):
        gate, up = gate_and_up(self.gate_proj, self.up_proj, x)
        return self.down_proj(jax.nn.gelu(gate, approximate=True) * up)


class DecoderLayer(nnx.Module):
    """Attention and MLP, each between a pre-norm and a post-norm, each added to the residual."""

    def __init__(self, cfg: Gemma3Config, index: int, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(cfg, index, rngs)
        self.mlp = MLP(cfg, rngs)

    def _mlp(self, x):
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def dense(self, x):
        """The layer over one whole sequence, uncached."""
        return self._mlp(x + self.post_attention_layernorm(self.self_attn.dense(self.input_layernorm(x))))

    def paged(self, x, positions, cache: KVCache, metadata: AttentionMetadata, impl: str):
        """The layer over a ragged batch, through the paged cache."""
        a, cache = self.self_attn.paged(self.input_layernorm(x), positions, cache, metadata, impl)
        return self._mlp(x + self.post_attention_layernorm(a)), cache


class Gemma3LM(nnx.Module):
    """Gemma 3 text decoder with tied embeddings."""

    def __init__(self, cfg: Gemma3Config, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=cfg.param_dtype,
                                      dtype=cfg.param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(len(cfg.layers))])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.lm_head = None  # tied to embed_tokens; an int8 copy after ``quant.quantize_model``

    def _embed(self, tokens):
        x = self.embed_tokens(tokens)
        return x * jnp.asarray(math.sqrt(self.cfg.hidden_size), x.dtype)

    def logits(self, x):
        """Logits ``f32[N, vocab]`` of final hidden states ``[N, hidden]`` (``hidden``'s, or the paged ones)."""
        x = self.norm(x)
        logits = two_rows_at_least(self.embed_tokens.attend, x) if self.lm_head is None else self.lm_head(x)
        return capped(logits.astype(jnp.float32), self.cfg.final_soft_cap)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The last layer's hidden states ``[L, hidden]`` of one whole sequence ``i32[L]``, without any cache
        (``logits`` turns them into logits)."""
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer.dense(x)
        return x

    def dense(self, tokens: jax.Array) -> jax.Array:
        """Logits ``f32[L, vocab]`` of one whole sequence, without any cache."""
        return self.logits(self.hidden(tokens))

    def key_centre_inputs(self, tokens: jax.Array):
        """Each attention layer with a key centre and its input over ``tokens``, uncached
        (``key_centre.calibrate_key_centres``)."""
        x = self._embed(tokens)
        for layer in self.layers:
            if layer.self_attn.key_centre is not None:
                yield layer.self_attn, layer.input_layernorm(x)
            x = layer.dense(x)

    def paged(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, metadata: AttentionMetadata,
              impl: str = "auto", sample_at: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """A ragged batch of new tokens through the paged cache: logits ``f32[S, vocab]`` at the token
        indices ``sample_at`` (default: every token), and the cache (``hkv_jax.models.PagedModel``)."""
        t, rows = tokens.shape[0], gemm_rows(tokens.shape[0])  # a single token runs as two rows on a GPU
        x, positions = self._embed(pad_rows(tokens, rows)), pad_rows(positions, rows)
        for layer in self.layers:
            x, cache = layer.paged(x, positions, cache, metadata, impl)
        return self.logits(x[:t] if sample_at is None else x[sample_at]), cache
