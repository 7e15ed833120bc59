"""128-bit chained block hashes in jnp, and their host-side (numpy) twin.

``hash(parent, block tokens, extra keys)`` chains from a fixed seed: a block's
hash depends on every token before it, the cache salt (first block) and any
extra keys (LoRA id, multimodal hashes). Four 32-bit lanes are mixed with one
another after every token, so the 128 bits are one state, not four weak
hashes. Not cryptographic; 128 bits make an accidental collision between two
cached prefixes negligible (the design asks for at least 128 bits).

The jnp version is vectorised over requests (``vmap``) and chains over blocks
with ``lax.scan``; ``np_*`` functions compute the same bits on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LANES = 4
SEED = np.array([0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F], dtype=np.uint32)
_MUL = np.array([0xCC9E2D51, 0x1B873593, 0xE6546B64, 0x85EBCA77], dtype=np.uint32)


def _rotl(x, r: int, xp):
    return (x << xp.uint32(r)) | (x >> xp.uint32(32 - r))


def _absorb(state, word, xp):
    """Mix one 32-bit word into the 4-lane state (same arithmetic for jnp and numpy)."""
    mul = xp.asarray(_MUL)
    s = state ^ (word * mul)
    s = _rotl(s, 15, xp) * mul[::-1]
    # Cross-lane diffusion: each lane takes in its right neighbour.
    return s + _rotl(xp.roll(s, -1, axis=-1), 7, xp) + xp.uint32(0x6B43A9B5)


def _finalize(state, xp):
    s = state ^ (state >> xp.uint32(16))
    s = s * xp.uint32(0x85EBCA6B)
    s = s ^ (s >> xp.uint32(13))
    s = s * xp.uint32(0xC2B2AE35)
    s = s ^ (s >> xp.uint32(16))
    return s ^ xp.roll(s, 2, axis=-1)


def _hash_block(parent, tokens, extra, xp):
    state = parent
    for t in range(tokens.shape[-1]):
        state = _absorb(state, tokens[..., t : t + 1].astype(xp.uint32), xp)
    for e in range(extra.shape[-1]):
        state = _absorb(state, extra[..., e : e + 1].astype(xp.uint32), xp)
    return _finalize(state, xp)


def np_block_hashes(tokens, block_size: int, first_extra=(), extra=()) -> np.ndarray:
    """Host twin: hashes (``u32[num_full_blocks, 4]``) of the full blocks of ``tokens``.

    ``first_extra`` (e.g. the cache salt) keys the first block only; ``extra``
    (e.g. a LoRA id) keys every block.
    """
    toks = np.asarray(tokens, dtype=np.int64).astype(np.uint32)
    n = len(toks) // block_size
    out = np.zeros((n, LANES), dtype=np.uint32)
    parent = SEED.copy()
    with np.errstate(over="ignore"):
        for i in range(n):
            keys = np.asarray((list(first_extra) if i == 0 else []) + list(extra), dtype=np.int64).astype(np.uint32)
            parent = _hash_block(parent, toks[i * block_size : (i + 1) * block_size], keys, np)
            out[i] = parent
    return out


def block_hashes(tokens: jax.Array, block_size: int, first_extra: jax.Array, extra: jax.Array) -> jax.Array:
    """Hashes ``u32[..., num_blocks, 4]`` of the full blocks of ``tokens`` (``i32[..., L]``).

    ``first_extra`` (``u32[..., E1]``) keys block 0, ``extra`` (``u32[..., E2]``)
    every block. Batch dimensions are vmapped. Blocks past the known tokens
    are the caller's to ignore.
    """
    if tokens.ndim > 1:
        return jax.vmap(lambda t, f, e: block_hashes(t, block_size, f, e))(tokens, first_extra, extra)
    nblocks = tokens.shape[0] // block_size
    blocks = tokens[: nblocks * block_size].reshape(nblocks, block_size).astype(jnp.uint32)
    first_extra = first_extra.astype(jnp.uint32)
    extra = extra.astype(jnp.uint32)

    def step(parent, xs):
        i, blk = xs
        # Block 0 absorbs the first-block keys; later blocks absorb zeros in their place, which
        # the host twin matches by absorbing nothing (see ``_hash_block_masked``).
        h = _hash_block_masked(parent, blk, first_extra, i == 0, extra)
        return h, h

    _, out = jax.lax.scan(step, jnp.asarray(SEED), (jnp.arange(nblocks), blocks))
    return out


def hash_one_block(parent: jax.Array, blk: jax.Array, first_extra: jax.Array, is_first: jax.Array, extra: jax.Array) -> jax.Array:
    """Hash ``u32[4]`` of one block of tokens ``blk`` after ``parent`` (``block_hashes``' step)."""
    return _hash_block_masked(parent, blk.astype(jnp.uint32), first_extra.astype(jnp.uint32), is_first,
                              extra.astype(jnp.uint32))


def _hash_block_masked(parent, blk, first_extra, is_first, extra):
    state = parent
    for t in range(blk.shape[-1]):
        state = _absorb(state, blk[t : t + 1], jnp)
    for e in range(first_extra.shape[-1]):
        state = jnp.where(is_first, _absorb(state, first_extra[e : e + 1], jnp), state)
    for e in range(extra.shape[-1]):
        state = _absorb(state, extra[e : e + 1], jnp)
    return _finalize(state, jnp)
