"""The shipped model presets: real configs (trimmed to the fields we read) and tiny test models."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

_PACKAGE = "hkv_jax.models"


def preset_names() -> list[str]:
    """Names of the shipped presets, sorted."""
    root = resources.files(_PACKAGE) / "configs"
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any]:
    """The config dict of preset ``name`` (case-insensitive)."""
    key = name.lower()
    if key not in preset_names():
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    text = (resources.files(_PACKAGE) / "configs" / f"{key}.json").read_text()
    return json.loads(text)


def resolve_model(model: str) -> tuple[str, dict[str, Any]]:
    """(display name, config dict) for a preset name or a path to a ``config.json``."""
    path = Path(model)
    if path.suffix == ".json" or path.exists():
        if path.is_dir():
            path = path / "config.json"
        try:
            return path.stem if path.name != "config.json" else path.parent.name or str(path), json.loads(
                path.read_text()
            )
        except FileNotFoundError:
            raise ValueError(f"no such config file: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return model.lower(), load_preset(model)
