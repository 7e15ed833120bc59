"""What the engine needs of a model: ``PagedModel`` to serve it, ``ScoringModel`` to score prompts too."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from hkv_jax.attention import AttentionMetadata
from hkv_jax.cache import KVCache
from hkv_jax.spec import LayerSpec


class ModelConfig(Protocol):
    """A model's config as the engine reads it."""

    layers: tuple[LayerSpec, ...]  # one spec per layer: what its KV cache group needs
    vocab_size: int


@runtime_checkable
class PagedModel(Protocol):
    """An NNX model the engine serves (``hkv_jax.models.tiny.TinyLM``, ``hkv_jax.models.gemma3.Gemma3LM``)."""

    cfg: ModelConfig

    def paged(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, metadata: AttentionMetadata,
              impl: str = "auto", sample_at: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """A ragged batch of new tokens (``i32[T]`` at ``positions``) through the paged cache: the logits
        ``f32[S, vocab]`` at the token indices ``sample_at`` (default: every token), and the new cache."""
        ...


@runtime_checkable
class ScoringModel(PagedModel, Protocol):
    """A ``PagedModel`` whose prompts ``Engine.prompt_logprobs`` can score: its uncached forward in two parts."""

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The last hidden states ``[L, hidden]`` of one whole sequence, uncached (prompt scoring)."""
        ...

    def logits(self, x: jax.Array) -> jax.Array:
        """Logits ``f32[..., vocab]`` of hidden states."""
        ...
