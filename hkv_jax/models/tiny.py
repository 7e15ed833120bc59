"""Tiny hybrid decoder models in Flax NNX (random weights), built from a config dict.

One decoder covers the hybrids of the presets: per layer, full /
sliding-window / chunked-local attention or a Mamba-2 mixer as the layer
specs say, plus the family's options: QK-norm and Gemma 2 soft-caps
(``gemma3_text``), attention sinks (``gpt_oss``), NoPE global layers
(``llama4_text``, ``no_rope_layers``), Mamba-2 layers (``mamba_n_heads``
and friends; Jamba-like layouts), Gemma 4's full-attention layers with a KV
shape of their own (``global_head_dim``, ``num_global_key_value_heads``;
keys used as values with ``attention_k_eq_v``) and KV sharing (the last
``num_kv_shared_layers`` layers read an earlier layer's KV). Every model has
two forward passes:

- ``dense(tokens)``: uncached attention and recurrences over the whole
  sequence (the oracle);
- ``paged(tokens, positions, cache, metadata)``: a ragged batch through
  ``hkv_jax.attention.attention`` and the Mamba states in the pages,
  reading and writing the paged KV cache.
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
from hkv_jax.models.key_centre import KeyCentre, centred, keys_to_write, shift_invariant
from hkv_jax.models.layers import (
    Heads,
    Linear,
    capped,
    dense_attention,
    gate_and_up,
    gemm_rows,
    projected_heads,
    rope,
    take_heads,
)
from hkv_jax.models.mamba2 import Mamba2, Mamba2Config
from hkv_jax.spec import LayerSpec
from kernels_pallas.key_finish import KeyFinish, rope_frequencies
from kernels_pallas.reference import to_page_dtype


@dataclass(frozen=True)
class TinyConfig:
    """Static shape and options of a tiny decoder (hashable: usable as a jit static argument)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    qk_norm: bool = False
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    sinks: bool = False
    rope: tuple[bool, ...] = ()
    rope_theta: float = 10000.0
    mamba: Mamba2Config | None = None
    global_head_dim: int | None = None  # full-attention layers' head size (None: head_dim)
    num_global_kv_heads: int | None = None  # full-attention layers' KV heads (None: num_kv_heads)
    k_eq_v: bool = False  # full-attention layers use their keys as values (no value projection)

    @classmethod
    def from_hf(cls, config: dict[str, Any], kv_dtype: str = "float32") -> "TinyConfig":
        """The decoder a Hugging Face-style config dict describes (attention and Mamba-2 layers)."""
        cfg = text_config(config)
        layers = layers_from_hf_config(config, dtype=kv_dtype)
        mamba = None
        if any(l.recurrent for l in layers):
            if "mamba_n_heads" not in cfg:
                raise ValueError("tiny models support Mamba-2 layers only (mamba_n_heads, mamba_d_head, ...)")
            mamba = Mamba2Config(hidden_size=cfg["hidden_size"], num_heads=cfg["mamba_n_heads"],
                                 head_dim=cfg["mamba_d_head"], d_state=cfg["mamba_d_state"],
                                 n_groups=cfg.get("mamba_n_groups", 1), d_conv=cfg["mamba_d_conv"])
        family = cfg.get("model_type", "")
        n = len(layers)
        rope = tuple(bool(r) for r in cfg.get("no_rope_layers") or [1] * n)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            layers=tuple(layers), qk_norm=family.startswith(("gemma3", "gemma4")),
            attn_soft_cap=cfg.get("attn_logit_softcapping"), final_soft_cap=cfg.get("final_logit_softcapping"),
            sinks=family == "gpt_oss", rope=rope, rope_theta=float(cfg.get("rope_theta", 10000.0)),
            mamba=mamba, global_head_dim=cfg.get("global_head_dim"),
            num_global_kv_heads=cfg.get("num_global_key_value_heads"), k_eq_v=bool(cfg.get("attention_k_eq_v")))

    def kv_source(self, i: int) -> int:
        """The layer whose KV layer ``i`` attends over: itself, or the target of a KV-sharing layer."""
        spec = self.layers[i]
        if not spec.owns_kv:
            return next(j for j, l in enumerate(self.layers) if l.name == spec.target)
        return i

    def is_global(self, i: int) -> bool:
        """Whether layer ``i`` (or the layer whose KV it reads) is a full-attention layer."""
        return self.layers[self.kv_source(i)].keeps_every_token

    def head_shape(self, i: int) -> tuple[int, int]:
        """(KV heads, head size) of layer ``i``: full-attention layers may have their own (Gemma 4)."""
        if self.is_global(i):
            return self.num_global_kv_heads or self.num_kv_heads, self.global_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim

    def window(self, i: int) -> tuple[int | None, int | None]:
        """(sliding window, chunk size) of layer ``i``."""
        spec = self.layers[self.kv_source(i)]
        return spec.window, spec.chunk


class Attention(nnx.Module):
    """One attention layer; its KV lives in the cache under ``name`` (a KV-sharing layer has no K and V
    projections of its own: it attends over its target's)."""

    def __init__(self, cfg: TinyConfig, index: int, rngs: nnx.Rngs):
        self.cfg, self.index, self.name = cfg, index, cfg.layers[index].name
        self.kv_heads, d = cfg.head_shape(index)
        self.head_dim, h = d, cfg.hidden_size
        self.owns_kv = cfg.kv_source(index) == index
        self.kv_dtype = cfg.layers[index].dtype if self.owns_kv else None  # what its cache pages store
        self.v_is_k = cfg.k_eq_v and cfg.is_global(index)
        self.q = Linear(h, cfg.num_heads * d, use_bias=False, rngs=rngs)
        self.k = Linear(h, self.kv_heads * d, use_bias=False, rngs=rngs) if self.owns_kv else None
        own_v = self.owns_kv and not self.v_is_k
        self.v = Linear(h, self.kv_heads * d, use_bias=False, rngs=rngs) if own_v else None
        self.o = Linear(cfg.num_heads * d, h, use_bias=False, rngs=rngs)
        self.q_norm = nnx.RMSNorm(d, rngs=rngs) if cfg.qk_norm else None
        self.k_norm = nnx.RMSNorm(d, rngs=rngs) if cfg.qk_norm and self.owns_kv else None
        self.sinks = nnx.Param(jax.random.normal(rngs.params(), (cfg.num_heads,))) if cfg.sinks else None
        centre = self.owns_kv and shift_invariant(cfg.attn_soft_cap, self.sinks)
        self.key_centre = KeyCentre(jnp.zeros((self.kv_heads, d), jnp.float32)) if centre else None

    @property
    def rope_theta(self) -> float | None:
        """The RoPE base of this layer's keys, ``None`` for a layer without RoPE."""
        return self.cfg.rope_theta if not self.cfg.rope or self.cfg.rope[self.index] else None

    def _qkv(self, x, positions) -> tuple[jax.Array, Heads | None, KeyFinish, Heads | None]:
        """Queries, the raw keys and their finish (the K norm and RoPE, which the KV write applies:
        ``KeyFinish``), and where the values are (``layers.projected_heads``; the raw keys where keys serve
        as values); ``None`` for a KV-sharing layer's keys and values."""
        cfg, d, theta = self.cfg, self.head_dim, self.rope_theta
        heads = projected_heads(tuple(p for p in (self.q, self.k, self.v) if p is not None), x, d)
        q = take_heads(heads[0], cfg.num_heads)
        q = q if self.q_norm is None else self.q_norm(q)
        q = rope(q, positions, theta) if theta is not None else q
        norm = self.k_norm
        finish = KeyFinish(positions, None if norm is None else norm.scale[...],
                           None if theta is None else rope_frequencies(d, theta),
                           eps=1e-6 if norm is None else norm.epsilon)
        if not self.owns_kv:
            return q, None, finish, None
        return q, heads[1], finish, heads[1 if self.v_is_k else 2]

    def keys(self, x, positions) -> jax.Array:
        """The finished keys ``[T, Hkv, D]`` of inputs ``x: [T, hidden]`` at ``positions``."""
        _, k, finish, _ = self._qkv(x, positions)
        return finish.apply(take_heads(k, self.kv_heads))

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

    def dense(self, x, kv: dict[int, tuple[jax.Array, jax.Array]]):
        """Uncached attention over the whole sequence; ``kv`` holds each KV-owning layer's keys and values
        by index (this layer adds its own; a KV-sharing layer reads its target's)."""
        q, k, finish, values = self._qkv(x, jnp.arange(x.shape[0]))
        if self.owns_kv:  # rounded as the cache stores them (fp8, bf16; no-op for float32 pages)
            v = take_heads(values, self.kv_heads)
            k = centred(finish.apply(take_heads(k, self.kv_heads)), self.key_centre, self.kv_dtype)
            k, v = (to_page_dtype(t, self.kv_dtype).astype(t.dtype) for t in (k, v))
            kv[self.index] = k, v
        k, v = kv[self.cfg.kv_source(self.index)]
        window, chunk = self.cfg.window(self.index)
        out = dense_attention(q, k, v, window=window, chunk=chunk, soft_cap=self.cfg.attn_soft_cap,
                              sinks=self._sinks())
        return self.o(out.reshape(x.shape[0], -1))

    def paged(self, x, positions, cache: KVCache, metadata: AttentionMetadata, impl: str):
        q, k, finish, values = self._qkv(x, positions)
        values, v_head = values or (None, 0)
        k, k_head, finish = (None, 0, None) if k is None else keys_to_write(
            k, finish, self.kv_heads, self.key_centre, cache.layout.slot(self.name).spec.dtype)
        out, cache = attention(self.name, q, k, values, cache, metadata, k_head=k_head, k_finish=finish,
                               v_head=v_head, sinks=self._sinks(), soft_cap=self.cfg.attn_soft_cap, impl=impl)
        return self.o(out.reshape(x.shape[0], -1)), cache


class Block(nnx.Module):
    """Pre-norm mixer (attention or Mamba-2, as the layer's spec says) + gated MLP."""

    def __init__(self, cfg: TinyConfig, index: int, rngs: nnx.Rngs):
        spec = cfg.layers[index]
        self.mixer_norm = nnx.RMSNorm(cfg.hidden_size, rngs=rngs)
        self.mixer = (Mamba2(cfg.mamba, spec.name, rngs) if spec.recurrent
                      else Attention(cfg, index, rngs))
        self.mlp_norm = nnx.RMSNorm(cfg.hidden_size, rngs=rngs)
        self.gate = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=False, rngs=rngs)
        self.up = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=False, rngs=rngs)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, use_bias=False, rngs=rngs)

    def mlp(self, x):
        """``x + down(gelu(gate(h)) * up(h))`` of the normed ``h`` (gate and up: ``gate_and_up``)."""
        gate, up = gate_and_up(self.gate, self.up, self.mlp_norm(x))
        return x + self.down(jax.nn.gelu(gate) * up)

    def dense(self, x, kv: dict):
        """The block over one whole sequence, uncached (``kv``: ``Attention.dense``'s)."""
        h = self.mixer_norm(x)
        return self.mlp(x + (self.mixer.dense(h) if isinstance(self.mixer, Mamba2) else self.mixer.dense(h, kv)))

    def paged(self, x, positions, cache: KVCache, metadata: AttentionMetadata, impl: str):
        """The block over a ragged batch, through the paged cache."""
        h = self.mixer_norm(x)
        if isinstance(self.mixer, Mamba2):
            a, cache = self.mixer.paged(h, cache, metadata)
        else:
            a, cache = self.mixer.paged(h, positions, cache, metadata, impl)
        return self.mlp(x + a), cache


class TinyLM(nnx.Module):
    """A tiny hybrid decoder with tied embeddings."""

    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(len(cfg.layers))])
        self.norm = nnx.RMSNorm(cfg.hidden_size, rngs=rngs)

    def _embed(self, tokens):
        return self.embed(tokens) * math.sqrt(self.cfg.hidden_size)

    def logits(self, x):
        """Logits ``f32[N, vocab]`` of final hidden states ``[N, hidden]`` (``hidden``'s, or the paged ones)."""
        return capped(self.embed.attend(self.norm(x)), self.cfg.final_soft_cap)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The last layer's hidden states ``[L, hidden]`` of one whole sequence ``i32[L]``, without any cache
        (``logits`` turns them into logits)."""
        x, kv = self._embed(tokens), {}
        for b in self.blocks:
            x = b.dense(x, kv)
        return x

    def dense(self, tokens: jax.Array) -> jax.Array:
        """Logits ``f32[L, vocab]`` of one whole sequence, without any cache."""
        return self.logits(self.hidden(tokens))

    def key_centre_inputs(self, tokens: jax.Array):
        """Each attention layer with a key centre and its input over ``tokens``, uncached
        (``key_centre.calibrate_key_centres``)."""
        x, kv = self._embed(tokens), {}
        for b in self.blocks:
            if isinstance(b.mixer, Attention) and b.mixer.key_centre is not None:
                yield b.mixer, b.mixer_norm(x)
            x = b.dense(x, kv)

    def dense_states(self, tokens: jax.Array, length: jax.Array | int | None = None
                     ) -> dict[str, tuple[jax.Array, jax.Array]]:
        """The Mamba state ``(conv, ssm)`` of every Mamba layer (by name) after the first ``length``
        (default: all) tokens, uncached."""
        x, states, kv = self._embed(tokens), {}, {}
        for b in self.blocks:
            if isinstance(b.mixer, Mamba2):
                states[b.mixer.name] = b.mixer.dense_state(b.mixer_norm(x), length)
            x = b.dense(x, kv)
        return states

    def paged(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, metadata: AttentionMetadata,
              impl: str = "auto", sample_at: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """A ragged batch of new tokens (``i32[T]`` at ``positions``) through the paged cache: the logits
        ``f32[S, vocab]`` at the ``S`` token indices ``sample_at`` (default: every token), and the cache.

        This is the protocol ``hkv_jax.engine`` serves (``hkv_jax.models.PagedModel``). Logits only where a
        token is sampled: the vocabulary projection of every prefill token would cost ``T x vocab``.
        """
        t, rows = tokens.shape[0], gemm_rows(tokens.shape[0])  # a single token runs as two rows on a GPU
        x, positions = self._embed(pad_rows(tokens, rows)), pad_rows(positions, rows)
        for b in self.blocks:
            x, cache = b.paged(x, positions, cache, metadata, impl)
        return self.logits(x[:t] if sample_at is None else x[sample_at]), cache
