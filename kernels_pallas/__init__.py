"""Paged-attention kernels over hkv-jax's unified page buffers.

Shapes and conventions: ``reference.py``. Implementations (``impl``):

``reference``
    Dense pure jnp (gathers every token's whole block table at once); the oracle.
``blocked``
    Pure jnp, a loop over block-table columns with an online softmax
    (``blocked.py``): the reference's results without its per-token copies of
    the KV; the CPU/TPU path.
``triton``
    The portable Pallas kernels (``paged_attention_portable.py``,
    ``kv_write_portable.py``); Triton on GPUs before Hopper.
``mosaic_gpu``
    The Hopper path (``paged_attention_mgpu.py``).
``auto``
    ``mosaic_gpu`` on a GPU of compute capability 9.x when the shapes suit it
    (``paged_attention_mgpu.supported``), ``triton`` on other GPUs, ``blocked``
    elsewhere.

``interpret=True`` runs a Pallas implementation on CPU (tests).
"""

from __future__ import annotations

import jax

from kernels_pallas import blocked
from kernels_pallas import kv_write_portable as _kv_write
from kernels_pallas import paged_attention_portable as _portable
from kernels_pallas import paged_attention_mgpu as _mgpu
from kernels_pallas import reference
from kernels_pallas.reference import AttentionParams

IMPLS = ("auto", "reference", "blocked", "triton", "mosaic_gpu")


def default_impl() -> str:
    """The implementation ``auto`` picks on the default device."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return "blocked"
    cc = str(getattr(dev, "compute_capability", "0"))
    return "mosaic_gpu" if cc.startswith("9") else "triton"


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    return default_impl() if impl == "auto" else impl


def paged_attention(q, kv_pages, block_tables, query_start_loc, seq_lens, params: AttentionParams,
                    sinks=None, *, impl: str = "auto", interpret: bool = False):
    """Ragged paged attention with the chosen implementation (see ``reference.paged_attention``)."""
    chosen = _resolve(impl)
    if chosen == "mosaic_gpu" and impl == "auto" and _mgpu.supported(
            q.dtype, kv_pages.shape, kv_pages.dtype, q.shape[1]):
        chosen = "triton"
    impl = chosen
    args = (q, kv_pages, block_tables, query_start_loc, seq_lens, params, sinks)
    if impl == "reference":
        return reference.paged_attention(*args)
    if impl == "blocked":
        return blocked.paged_attention(*args)
    if impl == "mosaic_gpu":
        return _mgpu.paged_attention(*args, interpret=interpret)
    return _portable.paged_attention(*args, interpret=interpret)


def kv_write(kv_pages, k, v, slots, *, impl: str = "auto", interpret: bool = False):
    """Store new K/V at their slots with the chosen implementation (see ``reference.kv_write``).

    The Hopper path uses the portable Pallas write: a scatter of a few rows per
    token is bound by memory latency, not by the instructions that issue it.
    """
    if _resolve(impl) in ("reference", "blocked"):
        return reference.kv_write(kv_pages, k, v, slots)
    return _kv_write.kv_write(kv_pages, k, v, slots, interpret=interpret)


__all__ = ["AttentionParams", "IMPLS", "blocked", "default_impl", "kv_write", "paged_attention", "reference"]
