"""hkv-jax: a hybrid KV cache manager for JAX.

One paged KV memory pool with a unified page size serves sliding-window,
chunked-local, Mamba and full-attention layers (``DESIGN.md``). The public
pieces: layer specs (:mod:`hkv_jax.spec`), model presets
(:mod:`hkv_jax.models`), the planner (:mod:`hkv_jax.planner`).
"""

from hkv_jax.planner import KVCacheConfig, KVCacheGroup, plan
from hkv_jax.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVSharingSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "ChunkedLocalSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVSharingSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "plan",
]
__version__ = "0.1.0"
