"""Building blocks shared by the tiny models and Gemma 3: the linear layer, rotary embedding, Gemma's
RMSNorm, logit soft-capping, and the uncached attention that the dense oracle and prompt scoring run on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.attention import pad_rows
from kernels_pallas import target_device
from kernels_pallas.key_finish import rope_frequencies, rotate_halves


def two_rows_at_least(product, x: jax.Array) -> jax.Array:
    """``product(x)`` for ``x: [R, in]``, a single row padded to two (and the pad dropped after). A one-row
    product takes a slow path in XLA: on a GPU it becomes a multiply that writes a weight-sized product and
    a second kernel that sums it (three times the weight's bytes, two kernels; two rows make one GEMM); on
    a CPU it runs 8x slower than two rows for an int8 matrix and about 4x for a float32 one against a
    transposed matrix (the tied output projection)."""
    if x.shape[0] != 1:
        return product(x)
    return product(pad_rows(x, 2))[:1]


def gemm_rows(rows: int) -> int:
    """The rows a product over ``rows`` rows runs on: a single row runs as two on a GPU
    (``two_rows_at_least`` says why); elsewhere one row is as fast as two and needs no pad."""
    return 2 if rows == 1 and target_device()[0] == "gpu" else rows


class Linear(nnx.Linear):
    """``nnx.Linear`` whose one-row products (a batch-1 decode step) run as two where ``gemm_rows`` says so.
    A paged forward pass pads its single token once instead (the models' ``paged``), so that no layer pads
    its own input: on a GPU each pad is a kernel of its own that the GEMM could have fused."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        rows = inputs.reshape(-1, inputs.shape[-1])
        n = rows.shape[0]
        if gemm_rows(n) == n:
            return super().__call__(inputs)
        return super().__call__(pad_rows(rows, gemm_rows(n)))[:n].reshape(*inputs.shape[:-1], -1)

    @staticmethod
    def fused(parts: tuple["Linear", ...], inputs: jax.Array) -> jax.Array:
        """``[p(inputs) for p in parts]`` side by side on the last axis, as one product over the layers'
        kernels side by side (bias-free layers of one dtype; ``Int8Linear.fused`` is its int8 twin)."""
        first = parts[0]
        if any(p.bias is not None or p.dtype != first.dtype for p in parts):
            raise ValueError("Linear.fused takes bias-free layers of one dtype")
        kernel = jnp.concatenate([p.kernel[...] for p in parts], axis=1)
        x, kernel = first.promote_dtype((inputs, kernel), dtype=first.dtype)
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        y = first.dot_general(pad_rows(rows, gemm_rows(n)), kernel, (((1,), (0,)), ((), ())), precision=first.precision)
        return y[:n].reshape(*inputs.shape[:-1], -1)


def _columns_split() -> bool:
    """Whether the mesh in use has a ``model`` axis, which splits the linear layers' columns
    (``hkv_jax.sharding``). One product over several layers' kernels side by side would then hold each
    device's columns of every layer in the wrong place, and XLA moves (or gathers) its outputs between the
    devices every layer; the layers' own products keep each device's columns."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and dict(mesh.shape).get("model", 1) > 1


def gate_and_up(gate: nnx.Module, up: nnx.Module, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(gate(x), up(x))`` of a gated MLP: one product (``Linear.fused``; XLA:GPU runs two wide products as
    two kernels), or two under a mesh that splits their columns (``_columns_split``)."""
    if _columns_split():
        return gate(x), up(x)
    both = type(gate).fused((gate, up), x)
    return both[..., :both.shape[-1] // 2], both[..., both.shape[-1] // 2:]


Heads = tuple[jax.Array, int]  # (array [T, H, D], first): a layer's heads are array[:, first:first + its heads]


def projected_heads(parts: tuple[nnx.Module, ...], x: jax.Array, head_dim: int) -> list[Heads]:
    """Each of ``parts`` (an attention layer's query, key and value projections) over ``x: [T, in]`` as heads
    of ``head_dim``. On one device one product gives one array holding every part's heads side by side, so
    the KV write reads the values in place (``attention``'s ``v_head``); under a mesh that splits the
    columns (``_columns_split``) each part is its own product and array."""
    t = x.shape[0]
    if _columns_split():
        return [(p(x).reshape(t, -1, head_dim), 0) for p in parts]
    heads = type(parts[0]).fused(parts, x).reshape(t, -1, head_dim)
    firsts = [sum(p.out_features for p in parts[:i]) // head_dim for i in range(len(parts))]
    return [(heads, first) for first in firsts]


def take_heads(heads: Heads, count: int) -> jax.Array:
    """The ``count`` heads ``heads`` points at: ``[T, count, D]``."""
    array, first = heads
    return array[:, first:first + count]


def capped(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself when ``cap`` is ``None``."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``x: [T, H, D]`` at ``positions: i32[T]`` (half-split convention)."""
    half = x.shape[-1] // 2
    halves = rotate_halves(x[..., :half], x[..., half:], positions[:, None, None], rope_frequencies(2 * half, theta))
    return jnp.concatenate(halves, axis=-1).astype(x.dtype)


# Query rows whose scores ``dense_attention`` makes at a time in a long sequence: ``[Hq, 512, L]`` scores
# instead of ``[Hq, L, L]`` (16 GB for 4 heads at 32k tokens), so that a long prompt can be scored whole.
DENSE_QUERY_BLOCK = 512


def dense_attention(q, k, v, *, window, chunk, soft_cap, sinks, scale: float | None = None) -> jax.Array:
    """Causal attention over one whole sequence, ``q: [L, Hq, D]``, ``k, v: [L, Hkv, D]`` (the oracle path,
    and ``hidden``'s); scores scaled by ``scale`` (default ``D ** -0.5``). A sequence of several
    ``DENSE_QUERY_BLOCK`` rows runs a block of query rows at a time."""
    length, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    j = jnp.arange(length)[None, :]

    def rows(qb, first):  # query rows first, first + 1, ... against every key
        s = jnp.einsum("qhd,khd->hqk", qb, k) * (d ** -0.5 if scale is None else scale)
        s = capped(s, soft_cap)
        i = first + jnp.arange(qb.shape[0])[:, None]
        mask = j <= i
        if window is not None:
            mask &= i - j < window
        if chunk is not None:
            mask &= i // chunk == j // chunk
        s = jnp.where(mask, s, -jnp.inf)
        if sinks is not None:
            s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], (hq, qb.shape[0], 1))], axis=-1)
        p = jax.nn.softmax(s, axis=-1)[..., :length]
        return jnp.einsum("hqk,khd->qhd", p, v)

    block = DENSE_QUERY_BLOCK
    if length <= block or length % block:
        return rows(q, 0)
    starts = jnp.arange(0, length, block)
    out = jax.lax.map(lambda x: rows(*x), (q.reshape(length // block, block, hq, d), starts))
    return out.reshape(length, hq, d)


class RMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` in float32, ``w`` zero-centred (as checkpoints store it)."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
