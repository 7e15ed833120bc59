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


# The state is 4 separate uint32 lanes (arrays of the batch's shape), not one [..., 4] array: every
# step is then elementwise, which XLA fuses into one loop (rolling a [..., 4] array splits it into
# many small kernels).


def _lanes(state, xp) -> tuple:
    """``[..., 4]`` -> 4 lanes."""
    return tuple(state[..., i] for i in range(LANES))


def _absorb(lanes: tuple, word, xp) -> tuple:
    """Mix one 32-bit word (an array of the lanes' shape) into the 4 lanes (same arithmetic for jnp and numpy)."""
    s = [_rotl(lane ^ (word * xp.uint32(_MUL[i])), 15, xp) * xp.uint32(_MUL[LANES - 1 - i])
         for i, lane in enumerate(lanes)]
    # Cross-lane diffusion: each lane takes in its right neighbour.
    return tuple(s[i] + _rotl(s[(i + 1) % LANES], 7, xp) + xp.uint32(0x6B43A9B5) for i in range(LANES))


def _finalize(lanes: tuple, xp):
    """The lanes' hash as ``[..., 4]``."""
    mixed = []
    for s in lanes:
        s = s ^ (s >> xp.uint32(16))
        s = s * xp.uint32(0x85EBCA6B)
        s = s ^ (s >> xp.uint32(13))
        s = s * xp.uint32(0xC2B2AE35)
        mixed.append(s ^ (s >> xp.uint32(16)))
    return xp.stack([mixed[i] ^ mixed[(i + 2) % LANES] for i in range(LANES)], axis=-1)


def _hash_block(parent, tokens, extra, xp):
    lanes = _lanes(parent, xp)
    for t in range(tokens.shape[-1]):
        lanes = _absorb(lanes, tokens[..., t].astype(xp.uint32), xp)
    for e in range(extra.shape[-1]):
        lanes = _absorb(lanes, extra[..., e].astype(xp.uint32), xp)
    return _finalize(lanes, xp)


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


def hash_one_block(
    parent: jax.Array, blk: jax.Array, first_extra: jax.Array, is_first: jax.Array, extra: jax.Array
) -> jax.Array:
    """Hash ``u32[4]`` of one block of tokens ``blk`` after ``parent`` (``block_hashes``' step)."""
    return _hash_block_masked(parent, blk.astype(jnp.uint32), first_extra.astype(jnp.uint32), is_first,
                              extra.astype(jnp.uint32))


def _hash_block_masked(parent, blk, first_extra, is_first, extra):
    lanes = _lanes(parent, jnp)
    for t in range(blk.shape[-1]):
        lanes = _absorb(lanes, blk[..., t], jnp)
        if t % 2:  # bound XLA's fusions: one of the whole chain duplicates work (lanes feed each other)
            lanes = jax.lax.optimization_barrier(lanes)
    for e in range(first_extra.shape[-1]):
        absorbed = _absorb(lanes, first_extra[..., e], jnp)
        lanes = tuple(jnp.where(is_first, a, b) for a, b in zip(absorbed, lanes))
    for e in range(extra.shape[-1]):
        lanes = _absorb(lanes, extra[..., e], jnp)
    return _finalize(lanes, jnp)
