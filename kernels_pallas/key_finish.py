"""What turns a layer's raw key projection into the keys its pages store: RMSNorm, then RoPE.

A model may hand ``hkv_jax.attention.attention`` its raw keys (read in place from the fused QKV product,
like the values) and a ``KeyFinish`` instead of finished keys. On a GPU the portable KV write then
normalises and rotates each key as it stores it (``kv_write_portable``): one kernel where a norm-and-RoPE
kernel would otherwise run before the write, in every layer of every step. Every other path calls
``apply`` (the same arithmetic in jnp) before its write, and so does the model's uncached pass.

The arithmetic is written over the two halves of a key (``finish_halves``), the halves that RoPE's
half-split convention rotates into each other: a Triton program works on 1-D rows and has no
concatenation, so the kernel loads and stores the halves, and the jnp path splits and joins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_size: int, theta: float) -> np.ndarray:
    """RoPE's angle per position of each of the ``head_size // 2`` rotated pairs: ``f32[head_size // 2]``. A
    NumPy constant: computed under jit, XLA:GPU would run it as a kernel of its own in every step."""
    half = head_size // 2
    return (float(theta) ** (-np.arange(half, dtype=np.float64) / half)).astype(np.float32)


def rotate_halves(lo: jax.Array, hi: jax.Array, positions: jax.Array,
                  frequencies: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE (half-split) of a vector's halves ``lo, hi: [..., D/2]`` at ``positions`` (broadcast against
    them: ``[..., 1]``), in float32."""
    angle = positions.astype(jnp.float32) * frequencies
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return lo * cos - hi * sin, hi * cos + lo * sin


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KeyFinish:
    """A layer's key finish: ``rmsnorm`` (``x / rms(x) * (norm_offset + w)`` in float32, rounded to the raw
    keys' dtype, as the models' norm layers round), then RoPE at each token's position (rounded the same).

    ``positions: i32[T']`` (at least the batch's tokens); ``norm_weight: f32[D]`` or ``None`` (no norm);
    ``frequencies: f32[D/2]`` (``rope_frequencies``) or ``None`` (no RoPE). Static: ``norm_offset`` (1.0 for
    Gemma's zero-centred weights, 0.0 for plain ones) and ``eps``.
    """

    positions: jax.Array
    norm_weight: jax.Array | None = None
    frequencies: jax.Array | np.ndarray | None = None
    norm_offset: float = field(default=0.0, metadata=dict(static=True))
    eps: float = field(default=1e-6, metadata=dict(static=True))

    def apply(self, k: jax.Array) -> jax.Array:
        """The finished keys of raw keys ``k: [T, H, D]`` (``T`` at most ``positions``' length), in ``k``'s
        dtype."""
        half = k.shape[-1] // 2
        norm = None if self.norm_weight is None else (self.norm_weight[:half], self.norm_weight[half:])
        lo, hi = finish_halves(k[..., :half], k[..., half:], self.positions[:k.shape[0], None, None], norm,
                               self.frequencies, norm_offset=self.norm_offset, eps=self.eps)
        return jnp.concatenate([lo, hi], axis=-1)


def finish_halves(lo: jax.Array, hi: jax.Array, positions: jax.Array, norm: tuple[jax.Array, jax.Array] | None,
                  frequencies: jax.Array | None, *, norm_offset: float, eps: float) -> tuple[jax.Array, jax.Array]:
    """A ``KeyFinish`` on the halves ``lo, hi: [..., D/2]`` of raw keys at ``positions`` (broadcast against
    them), with the norm weight's halves ``norm`` and the RoPE ``frequencies`` (each ``None``: no norm, no
    RoPE): the finished halves, in the raw keys' dtype. The KV write's kernel calls it on one key's halves,
    ``KeyFinish.apply`` on whole arrays."""
    dtype = lo.dtype
    if norm is not None:
        lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
        squares = jnp.sum(lo32 * lo32, axis=-1, keepdims=True) + jnp.sum(hi32 * hi32, axis=-1, keepdims=True)
        scale = jax.lax.rsqrt(squares / (2 * lo.shape[-1]) + eps)
        w_lo, w_hi = (norm_offset + w.astype(jnp.float32) for w in norm)
        lo, hi = (lo32 * scale * w_lo).astype(dtype), (hi32 * scale * w_hi).astype(dtype)
    if frequencies is not None:
        lo, hi = rotate_halves(lo, hi, positions, frequencies)
    return lo.astype(dtype), hi.astype(dtype)
