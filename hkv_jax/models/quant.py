"""Int8 weights for the linear layers and the output projection (opt-in: ``quantize="int8"``).

Each weight matrix ``w: [in, out]`` is stored transposed, ``[out, in]``, as int8
with one float32 scale per output column (symmetric, ``max |w| / 127``): XLA:CPU
runs the product faster with both operands contracting their last dimension
(``benchmarks/README.md``). At run time each row of the activations gets its
own scale the same way, and the product is an int8 x int8 dot accumulated in
int32, rescaled to float32. On a CPU a decode step reads a quarter of the
weight bytes (it is memory-bound at small batches); at prefill sizes int8 is
about 3x faster than float32 on a CPU with AVX-512 VNNI, and no faster on one
with AVX2 only.

The result is not the float32 model: greedy generations drift from it after a
few tokens on some prompts, as they do for llama.cpp's 4-bit files. Tests and
parity stay on float32; ``benchmarks/real_model.py --quantize int8`` reports
both speed and agreement.

Rounding the activations also makes the result sensitive to the last bit of its
float inputs. On one device the engine is bitwise reproducible (chunking and
batching change nothing), but under a mesh XLA compiles the float parts around
the products differently. A value near a rounding step then lands on the other
side, and the following layers spread the difference: Gemma 3 270M on a 1x2
mesh gave two of four requests logits 1.4-2.2 away from one device's, and one
token differed after 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv_jax.models.layers import two_rows_at_least

QUANTIZE = ("int8",)


def check_quantize(quantize: str | None) -> None:
    """Raise ``ValueError`` unless ``quantize`` is ``None`` or one of ``QUANTIZE``."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE)}")


def quantize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(i8[in, out], f32[out])``: ``w ~= q * scale`` per output column (an all-zero column gets scale 1)."""
    w = np.asarray(w, np.float32)
    peak = np.abs(w).max(axis=0)
    scale = np.where(peak > 0, peak / 127, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def int8_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array) -> jax.Array:
    """``x @ (weight * scale[:, None]).T`` in float32 for ``weight: i8[out, in]``, with ``x: [..., in]``
    quantized per row to int8 on the fly."""
    def product(x):
        peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        x_scale = jnp.where(peak > 0, peak / 127, 1.0)
        xq = jnp.round(x / x_scale).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * x_scale * scale

    lead = x.shape[:-1]
    return two_rows_at_least(product, x.astype(jnp.float32).reshape(-1, x.shape[-1])).reshape(*lead, -1)


class Int8Linear(nnx.Module):
    """A bias-free linear layer holding ``weight: i8[out, in]`` (named and laid out as a PyTorch
    ``Linear.weight``, unlike ``nnx.Linear.kernel``) and ``scale: f32[out]``."""

    def __init__(self, kernel: np.ndarray, dtype: str = "float32"):
        """``kernel: [in, out]``, as ``nnx.Linear.kernel``; outputs are cast to ``dtype``."""
        q, scale = quantize_columns(kernel)
        self.weight = nnx.Param(jnp.asarray(np.ascontiguousarray(q.T)))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.dtype = dtype

    @property
    def out_features(self) -> int:
        """The layer's outputs (``nnx.Linear``'s name)."""
        return self.weight.shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return int8_matmul(x, self.weight[...], self.scale[...]).astype(self.dtype)

    @staticmethod
    def fused(parts: tuple["Int8Linear", ...], x: jax.Array) -> jax.Array:
        """``[p(x) for p in parts]`` side by side on the last axis, as one product (``Linear.fused``)."""
        weight = jnp.concatenate([p.weight[...] for p in parts])
        return int8_matmul(x, weight, jnp.concatenate([p.scale[...] for p in parts])).astype(parts[0].dtype)


def quantize_model(model: nnx.Module, quantize: str) -> nnx.Module:
    """Replace every bias-free ``nnx.Linear`` of ``model`` with an ``Int8Linear`` (in place; returned).

    A model with tied embeddings (``embed_tokens`` and an ``lm_head`` attribute set to ``None``, as
    ``Gemma3LM``) also gets an int8 output projection; the embedding lookup keeps float32 rows."""
    check_quantize(quantize)
    targets = [(parent, name, child) for _, parent in nnx.iter_graph(model) if isinstance(parent, nnx.Module)
               for name, child in vars(parent).items() if isinstance(child, nnx.Linear)]
    for parent, name, lin in targets:  # all checked first: a refused model stays as it was
        if lin.bias is not None:
            raise ValueError(f"{type(parent).__name__}.{name}: a linear layer with a bias is not supported")
    for parent, name, lin in targets:
        setattr(parent, name, Int8Linear(np.asarray(lin.kernel[...]), lin.dtype or "float32"))
    if hasattr(model, "lm_head") and model.lm_head is None and hasattr(model, "embed_tokens"):
        model.lm_head = nnx.data(Int8Linear(np.asarray(model.embed_tokens.embedding[...]).T))
    return model
