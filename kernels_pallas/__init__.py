"""Paged-attention kernels over hkv-jax's unified page buffers.

Shapes and conventions: ``reference.py``. Implementations (``impl``):

``reference``
    Dense pure jnp (gathers every token's whole block table at once); the oracle.
``blocked``
    Pure jnp, a loop over block-table columns (up to 8 an iteration) with an
    online softmax (``blocked.py``): the reference's results without its per-token copies of
    the KV; the CPU/TPU path.
``triton``
    The portable Pallas kernels (``paged_attention_portable.py``,
    ``kv_write_portable.py``); Triton on GPUs before Hopper.
``mosaic_gpu``
    The Hopper path (``paged_attention_mgpu.py``).
``tpu``
    The Pallas TPU kernel (``paged_attention_tpu.py``): pages stay in HBM and
    are DMA'd into VMEM one at a time.
``triton_interpret``, ``tpu_interpret``
    The portable or the TPU kernel in interpret mode, on any backend (engine
    tests on CPU run the accelerator kernels' code this way).
``auto``
    Per call, so per KV cache group, from the shapes (decided when the step is
    traced): on a GPU of compute capability 9.x ``mosaic_gpu`` when
    ``paged_attention_mgpu.supports`` takes the shapes, else ``triton`` when
    ``paged_attention_portable.supports`` does, else ``blocked``; on a TPU
    ``tpu`` when ``paged_attention_tpu.supports`` takes them, else
    ``blocked``; ``blocked`` elsewhere (``choose``).

``interpret=True`` runs a Pallas implementation on CPU (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import (
    blocked,
    kv_write_portable,
    paged_attention_mgpu,
    paged_attention_portable,
    paged_attention_tpu,
    reference,
)
from kernels_pallas.key_finish import KeyFinish
from kernels_pallas.reference import AttentionParams
from kernels_pallas.support import YES, Support

IMPLS = ("auto", "reference", "blocked", "triton", "mosaic_gpu", "tpu", "triton_interpret", "tpu_interpret")


HOPPER = ("H100", "H200", "H800", "H20")  # device kinds of compute capability 9.x


def target_device() -> tuple[str, bool]:
    """``(platform, hopper)`` of the device programs are built for: the abstract mesh's device while one
    is in use (lowering for a GPU from a CPU-only machine), else the default device; ``hopper``: a GPU of
    compute capability 9.x."""
    mesh = jax.sharding.get_abstract_mesh()
    abstract = None if mesh.empty else mesh.abstract_device
    if abstract is not None:
        return abstract.platform, any(k in abstract.device_kind for k in HOPPER)
    dev = jax.devices()[0]
    return dev.platform, str(getattr(dev, "compute_capability", "0")).startswith("9")


def default_impl() -> str:
    """The implementation ``auto`` prefers (shapes permitting: ``choose``) on ``target_device()``."""
    platform, hopper = target_device()
    if platform == "tpu":
        return "tpu"
    if platform != "gpu":
        return "blocked"
    return "mosaic_gpu" if hopper else "triton"


def _known(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    return impl


def supports(impl: str, kv_pages_shape: tuple[int, ...], kv_dtype, num_q_heads: int, max_blocks: int = 0) -> Support:
    """Whether attention kernel ``impl`` takes these shapes (with the reason when it does not); the jnp
    implementations take every shape."""
    if impl == "mosaic_gpu":  # q is cast to the dtype this kernel multiplies in: q's own dtype does not matter
        return paged_attention_mgpu.supports(paged_attention_mgpu.compute_dtype(kv_dtype), kv_pages_shape, kv_dtype,
                                             num_q_heads, max_blocks)
    if impl == "triton":
        return paged_attention_portable.supports(kv_pages_shape, num_q_heads)
    if impl == "tpu":
        return paged_attention_tpu.supports(kv_pages_shape, kv_dtype, num_q_heads)
    return YES


def choose(impl: str, kv_pages_shape: tuple[int, ...], kv_dtype, num_q_heads: int, max_blocks: int = 0) -> str:
    """The implementation ``impl`` runs for these shapes: itself, or for ``auto`` the first of
    ``mosaic_gpu -> triton -> blocked`` (GPUs) or ``tpu -> blocked``, starting at ``default_impl()``,
    whose ``supports`` takes them (``max_blocks``: the block table's width). Raises ``ValueError`` for an
    unknown ``impl``."""
    if _known(impl) != "auto":
        return impl
    first = default_impl()
    order = ("tpu", "blocked") if first == "tpu" else ("mosaic_gpu", "triton", "blocked")
    for candidate in order[order.index(first):]:
        if supports(candidate, kv_pages_shape, kv_dtype, num_q_heads, max_blocks):
            return candidate
    raise AssertionError("blocked takes every shape")


def paged_attention(q, kv_pages, block_tables, query_start_loc, seq_lens, params: AttentionParams,
                    sinks=None, *, impl: str = "auto", interpret: bool = False, out_rows: int | None = None):
    """Ragged paged attention with the chosen implementation (see ``reference.paged_attention``).

    The Mosaic GPU kernel multiplies in the KV dtype (bf16 over fp8 pages, ``paged_attention_mgpu.compute_dtype``):
    q is cast to it, the output back to q's dtype. ``out_rows``: the output's rows (default ``T``), zeros past
    the tokens' (a model's padding rows); the Mosaic GPU kernel's last pass writes them, where a pad after it
    would be a kernel of its own in every layer.
    """
    impl = choose(impl, kv_pages.shape, kv_pages.dtype, q.shape[1], block_tables.shape[1])
    if impl.endswith("_interpret"):
        impl, interpret = impl.removesuffix("_interpret"), True
    args = (kv_pages, block_tables, query_start_loc, seq_lens, params, sinks)
    if impl == "mosaic_gpu":
        compute = paged_attention_mgpu.compute_dtype(kv_pages.dtype)
        return paged_attention_mgpu.paged_attention(q.astype(compute), *args, interpret=interpret,
                                                    out_rows=out_rows).astype(q.dtype)
    if impl == "tpu":
        out = paged_attention_tpu.paged_attention(q, *args, interpret=interpret)
    elif impl == "reference":
        out = reference.paged_attention(q, *args)
    elif impl == "blocked":
        out = blocked.paged_attention(q, *args)
    else:
        out = paged_attention_portable.paged_attention(q, *args, interpret=interpret)
    if out_rows is None or out_rows == out.shape[0]:
        return out
    return jnp.pad(out, ((0, out_rows - out.shape[0]), (0, 0), (0, 0)))


def kv_write(kv_pages, k, v, slots, *, k_head: int = 0, v_head: int = 0, k_finish: KeyFinish | None = None,
             impl: str = "auto", interpret: bool = False):
    """Store new K/V at their slots with the chosen implementation (see ``reference.kv_write``). The keys
    are heads ``[k_head, k_head + Hkv)`` and the values heads ``[v_head, v_head + Hkv)`` of the first ``T``
    rows (``T``: the slots) of ``k`` and ``v`` (``kv_write_portable.kv_write``): a fused QKV product's
    output, which the Pallas write reads in place (a copy of its columns would be a kernel of its own on a
    GPU). ``k_finish``: the keys are raw, and are finished (``KeyFinish``: RMSNorm, RoPE) before they are
    stored; the Pallas write does it as it stores them (a kernel fewer on a GPU).

    The Hopper path uses the portable Pallas write: a scatter of a few rows per
    token is bound by memory latency, not by the instructions that issue it.
    ``auto`` uses it on GPUs where the portable kernel takes the shapes, else
    the jnp scatter (TPUs included: XLA's scatter writes the pages in place).
    """
    if _known(impl) == "auto":
        kernel = default_impl() in ("triton", "mosaic_gpu") and bool(kv_write_portable.supports(kv_pages.shape))
    else:
        kernel = impl in ("triton", "mosaic_gpu", "triton_interpret")
        interpret |= impl == "triton_interpret"
    num_tokens, hkv = slots.shape[0], kv_pages.shape[2]
    if kernel and not reference.is_fp8(kv_pages.dtype):
        return kv_write_portable.kv_write(kv_pages, k, v, slots, interpret=interpret, k_head=k_head,
                                          v_head=v_head, k_finish=k_finish)
    k, v = k[:num_tokens, k_head:k_head + hkv], v[:num_tokens, v_head:v_head + hkv]
    k = k if k_finish is None else k_finish.apply(k)
    if not kernel:
        return reference.kv_write(kv_pages, k, v, slots)
    # fp8 pages: saturated here (``to_page_dtype``), so that the kernel's store is a plain cast.
    k, v = (reference.to_page_dtype(x, kv_pages.dtype) for x in (k, v))
    return kv_write_portable.kv_write(kv_pages, k, v, slots, interpret=interpret)


__all__ = ["AttentionParams", "IMPLS", "KeyFinish", "blocked", "choose", "default_impl", "kv_write", "paged_attention",
           "reference"]
