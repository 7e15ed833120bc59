"""Model presets: layer specs built from Hugging Face ``config.json`` dicts.

``layers_from_hf_config(cfg)`` reads a config; ``load_preset(name)`` returns
one of the shipped configs (``preset_names()`` lists them); ``model_layers``
does both for a preset name or a config path. ``PagedModel`` is the protocol
the engine serves.
"""

from __future__ import annotations

from hkv_jax.models.hf_config import layers_from_hf_config
from hkv_jax.models.presets import load_preset, preset_names, resolve_model
from hkv_jax.models.protocol import ModelConfig, PagedModel, ScoringModel
from hkv_jax.spec import LayerSpec


def model_layers(model: str, *, dtype: str | None = None) -> tuple[LayerSpec, ...]:
    """Layer specs of a preset name or a path to a ``config.json``."""
    return layers_from_hf_config(resolve_model(model)[1], dtype=dtype)


__all__ = [
    "ModelConfig",
    "PagedModel",
    "ScoringModel",
    "layers_from_hf_config",
    "load_preset",
    "model_layers",
    "preset_names",
    "resolve_model",
]
