"""Scatter new K/V into a layer's pages, in place (Pallas; Triton on GPU, interpret on CPU).

One program per token and kv head: it writes that head's K and V rows
(``head_size`` values each, so any number of kv heads lowers for Triton) at
the token's slot; slot -1 (padding, or a position whose block is the null
block) writes nothing. The page view is aliased to the output, so under jit
with a donated cache the write happens in the buffer itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.paged_attention_portable import pow2_at_least
from kernels_pallas.support import YES, Support, no


def supports(kv_pages_shape: tuple[int, ...]) -> Support:
    """Why this kernel cannot write into pages of this shape (``None`` when it can)."""
    d = kv_pages_shape[-1]
    if d != pow2_at_least(d):
        return no(f"head_size {d} (Triton rows need a power of 2)")
    return YES


def _kernel(slots_ref, k_ref, v_ref, kv_in_ref, kv_ref):
    del kv_in_ref  # aliased to kv_ref
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]
    bs = kv_ref.shape[3]

    @pl.when(slot >= 0)
    def _():
        page, off = slot // bs, slot % bs
        kv_ref[page, 0, h, off] = k_ref[...].astype(kv_ref.dtype)
        kv_ref[page, 1, h, off] = v_ref[...].astype(kv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "v_head"))
def kv_write(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, *,
             interpret: bool = False, v_head: int = 0) -> jax.Array:
    """Store ``k: [T, Hkv, D]`` and V into ``kv_pages: [N, 2, Hkv, bs, D]`` at ``slots: i32[T]``: V is heads
    ``[v_head, v_head + Hkv)`` of the first ``T`` rows of ``v: [T', H, D]`` (a fused QKV product's output,
    read in place: no copy of V's columns first).

    The output aliases ``kv_pages``: donate the cache in the enclosing jit to write in
    place. Slots must be distinct (two tokens never share a slot).
    """
    num_tokens, hkv, d = k.shape
    if (kv_pages.shape[2] != hkv or kv_pages.shape[4] != d or v.shape[0] < num_tokens or v.shape[2] != d
            or not 0 <= v_head <= v.shape[1] - hkv):
        raise ValueError(f"k {k.shape} / v {v.shape} (heads from {v_head}) do not fit kv_pages {kv_pages.shape}")
    support = supports(kv_pages.shape)
    if not support:
        raise ValueError(f"the portable KV write does not take {support.reason}")
    whole = pl.BlockSpec(kv_pages.shape, lambda t, h: (0,) * 5)
    row = pl.BlockSpec((None, None, d), lambda t, h: (t, h, 0))
    return pl.pallas_call(
        _kernel,
        grid=(num_tokens, hkv),
        in_specs=[pl.BlockSpec(slots.shape, lambda t, h: (0,)), row,
                  pl.BlockSpec((None, None, d), lambda t, h: (t, v_head + h, 0)), whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
        name="hkv_kv_write",
    )(slots.astype(jnp.int32), k, v, kv_pages)
