"""Scatter new K/V into a layer's pages, in place (Pallas; Triton on GPU, interpret on CPU).

One program per token and kv head: it writes that head's K and V rows
(``head_size`` values each, so any number of kv heads lowers for Triton) at
the token's slot; slot -1 (padding, or a position whose block is the null
block) writes nothing. K and V are read in place from wider arrays (a fused
QKV product's output), and a ``KeyFinish`` turns raw keys into the stored
ones (RMSNorm, RoPE) on the way. The page view is aliased to the output, so
under jit with a donated cache the write happens in the buffer itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.key_finish import KeyFinish, finish_halves
from kernels_pallas.paged_attention_portable import pow2_at_least
from kernels_pallas.support import YES, Support, no


def supports(kv_pages_shape: tuple[int, ...]) -> Support:
    """Why this kernel cannot write into pages of this shape (``None`` when it can)."""
    d = kv_pages_shape[-1]
    if d != pow2_at_least(d):
        return no(f"head_size {d} (Triton rows need a power of 2)")
    return YES


def _kernel(slots_ref, *refs, finish: tuple[bool, bool, float, float] | None):
    """Refs after ``slots_ref``: with a finish (``(norm, rope, norm_offset, eps)``), the positions, then the
    norm weight and the RoPE frequencies where it has them; then K, V, the pages (aliased to the output)
    and the output."""
    if finish is not None:
        has_norm, has_rope, norm_offset, eps = finish
        pos_ref, *refs = refs
        norm_ref = refs.pop(0) if has_norm else None
        freq_ref = refs.pop(0) if has_rope else None
    k_ref, v_ref, _, kv_ref = refs
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]
    bs = kv_ref.shape[3]

    @pl.when(slot >= 0)
    def _():
        page, off = slot // bs, slot % bs
        kv_ref[page, 1, h, off] = v_ref[...].astype(kv_ref.dtype)
        if finish is None:
            kv_ref[page, 0, h, off] = k_ref[...].astype(kv_ref.dtype)
            return
        half = k_ref.shape[0] // 2
        lo, hi = pl.ds(0, half), pl.ds(half, half)
        norm = None if norm_ref is None else (norm_ref[lo], norm_ref[hi])
        k_lo, k_hi = finish_halves(k_ref[lo], k_ref[hi], pos_ref[t], norm, None if freq_ref is None else freq_ref[...],
                                   norm_offset=norm_offset, eps=eps)
        kv_ref[page, 0, h, off, lo] = k_lo.astype(kv_ref.dtype)
        kv_ref[page, 0, h, off, hi] = k_hi.astype(kv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "k_head", "v_head"))
def kv_write(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, *, interpret: bool = False,
             k_head: int = 0, v_head: int = 0, k_finish: KeyFinish | None = None) -> jax.Array:
    """Store K and V into ``kv_pages: [N, 2, Hkv, bs, D]`` at ``slots: i32[T]``: K is heads
    ``[k_head, k_head + Hkv)`` and V heads ``[v_head, v_head + Hkv)`` of the first ``T`` rows of
    ``k, v: [T', H, D]`` (a fused QKV product's output, read in place: no copy of their columns first).
    ``k_finish``: the keys are raw, and each is finished (``KeyFinish``) as it is stored.

    The output aliases ``kv_pages``: donate the cache in the enclosing jit to write in
    place. Slots must be distinct (two tokens never share a slot).
    """
    num_tokens, (_, _, hkv, _, d) = slots.shape[0], kv_pages.shape
    fits = lambda x, first: x.shape[0] >= num_tokens and x.shape[2] == d and 0 <= first <= x.shape[1] - hkv  # noqa: E731
    if not (fits(k, k_head) and fits(v, v_head)):
        raise ValueError(f"k {k.shape} (heads from {k_head}) / v {v.shape} (heads from {v_head}) do not fit "
                         f"kv_pages {kv_pages.shape} and {num_tokens} slots")
    support = supports(kv_pages.shape)
    if not support:
        raise ValueError(f"the portable KV write does not take {support.reason}")
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731
    finish = None if k_finish is None else (k_finish.norm_weight is not None, k_finish.frequencies is not None,
                                            k_finish.norm_offset, k_finish.eps)
    finish_args = () if k_finish is None else tuple(
        x for x in (k_finish.positions.astype(jnp.int32), k_finish.norm_weight, k_finish.frequencies)
        if x is not None)
    args = (slots.astype(jnp.int32), *finish_args, k, v, kv_pages)
    return pl.pallas_call(
        functools.partial(_kernel, finish=finish),
        grid=(num_tokens, hkv),
        in_specs=[*(whole(x) for x in args[:1 + len(finish_args)]),
                  pl.BlockSpec((None, None, d), lambda t, h: (t, k_head + h, 0)),
                  pl.BlockSpec((None, None, d), lambda t, h: (t, v_head + h, 0)), whole(kv_pages)],
        out_specs=whole(kv_pages),
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={len(args) - 1: 0},
        interpret=interpret,
        name="hkv_kv_write",
    )(*args)
