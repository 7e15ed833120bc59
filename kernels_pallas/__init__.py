"""Pallas paged-attention kernels over hkv-jax's unified page buffers.

Planned contents (see ``DESIGN.md``): ``reference.py`` (dense pure-jnp oracle),
``kv_write.py`` and ``paged_attention.py`` with Mosaic GPU, TPU and
interpret-mode variants. Nothing is implemented here yet.
"""
