"""vLLM's single-type managers in jnp: each KV cache group type's rules, written once.

One manager class per layer type, found from a group's spec by ``manager(spec)`` (one map from spec type
to manager, as vLLM's ``spec_manager_map``; a new layer type plugs in there): which tokens a group no longer
needs (``skipped_tokens``), which table entries a request releases as it advances (``release``), which
blocks can ever serve a hit (``reachable``), whether blocks leave its window (``windowed``), and its
prefix-cache hit rule (``hit_blocks``). ``allocation`` and ``release_row`` apply them to group ``g`` of a
layout. The coordinator (``coordinator.py``) combines the groups of a model; the batched steps
(``prefill.py``, ``decode.py``) broadcast or vmap the same functions over requests. Every function is
shape-polymorphic in its per-request arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.planner import cdiv
from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from hkv_jax.allocator.state import Layout


def eviction_order(row: jax.Array, lo, hi) -> jax.Array:
    """Entries ``row[hi-1], row[hi-2], ..., row[lo]`` then zeros: the order one free call releases them in."""
    idx = jnp.arange(row.shape[0])
    pos = hi - 1 - idx
    return jnp.where(pos >= lo, row[jnp.clip(pos, 0, row.shape[0] - 1)], 0)


def _first_false(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """Smallest index >= start where ``mask`` is False (len(mask) if none)."""
    idx = jnp.arange(mask.shape[0])
    return jnp.min(jnp.where((idx >= start) & ~mask, idx, mask.shape[0]))


def _window_blocks(spec: SlidingWindowSpec, bs: int) -> int:
    """Blocks a sliding-window hit must have cached before its end: those the window reaches into."""
    return max(cdiv(spec.sliding_window - 1, bs), 1)


class FullAttentionManager:
    """Full attention: every token's block stays; a hit is the longest run of cached blocks from the first."""

    windowed: ClassVar[bool] = False  # blocks leave the group's window as the request advances

    @staticmethod
    def skipped_tokens(spec, num_computed: jax.Array) -> jax.Array:
        """Tokens whose blocks a group of ``spec`` no longer needs after ``num_computed`` tokens."""
        return jnp.zeros_like(num_computed)

    @staticmethod
    def reachable(spec, bs: int, segment: int, n: int) -> np.ndarray:
        """``bool[n]``: which of the first ``n`` blocks can ever serve a hit (``segment``: blocks per
        scheduling unit)."""
        return np.ones(n, bool)

    @classmethod
    def host_reachable(cls, spec, bs: int, segment: int, n: int) -> np.ndarray:
        """``bool[n]``: which of the first ``n`` blocks a hit ending on a multiple of ``segment`` blocks
        (the host tier's unit) needs: what the host tier keeps as blocks are computed (``host_tier.py``)."""
        return cls.reachable(spec, bs, segment, n)

    @staticmethod
    def hit_start(spec, bs: int, max_len: jax.Array) -> jax.Array | int:
        """The first block a hit within ``max_len`` tokens needs."""
        return 0

    @classmethod
    def hit_blocks(cls, spec, bs: int, unit: int, found: jax.Array, all_found: jax.Array, max_len: jax.Array):
        """Longest hit of one spec group (block size ``bs``) within ``max_len`` tokens, ending on a multiple
        of ``unit`` tokens (the scheduling unit: the lcm of every group's block size).

        ``found``: ``i32[k, H]`` cached block per group of the spec group and block
        index (0 = miss); ``all_found``: ``bool[H]`` every group hits. Returns
        (blocks ``i32[k, H]`` with 0 where no block is needed, hit length in tokens).
        """
        idx = jnp.arange(all_found.shape[0])
        segment = unit // bs  # blocks per scheduling unit
        start = cls.hit_start(spec, bs, max_len)
        nblocks = jnp.minimum(_first_false(all_found, start), max_len // bs) // segment * segment
        keep = (idx >= start) & (idx < nblocks)
        return jnp.where(keep[None, :], found, 0), nblocks * bs

    @staticmethod
    def release(row, length, retired, last_state, computed, skip, bs):
        """``(row, retired, released i32[2, M])`` after nulling the entries of the skipped tokens: walking
        back from the last skipped entry, stopping at the first null one (released earlier)."""
        idx = jnp.arange(row.shape[0])
        sb = jnp.where(skip > 0, jnp.minimum(skip // bs, length), 0)
        last_null = jnp.max(jnp.where((idx < sb) & (row == 0), idx, -1))
        freed = eviction_order(row, last_null + 1, sb)
        row = jnp.where((idx > last_null) & (idx < sb), 0, row)
        return row, retired, jnp.stack([freed, jnp.zeros_like(row)])


class ChunkedLocalManager(FullAttentionManager):
    """Chunked local attention: the blocks before the current chunk go; a hit needs the current chunk's."""

    windowed = True

    @staticmethod
    def skipped_tokens(spec, num_computed):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size

    @staticmethod
    def hit_start(spec, bs, max_len):
        return jnp.where(max_len > 0, max_len // spec.attention_chunk_size * spec.attention_chunk_size // bs, 0)

    @staticmethod
    def host_reachable(spec, bs, segment, n):
        # The blocks of the chunk that holds the end of their segment.
        i, chunk = np.arange(n), spec.attention_chunk_size
        return i * bs >= (i // segment + 1) * segment * bs // chunk * chunk


class SlidingWindowManager(FullAttentionManager):
    """Sliding-window attention: blocks out of the window go; a hit needs only the window's blocks before
    its end, so it may end after a miss."""

    windowed = True

    @staticmethod
    def skipped_tokens(spec, num_computed):
        return jnp.maximum(0, num_computed - spec.sliding_window + 1)

    @staticmethod
    def reachable(spec, bs, segment, n):
        # Hits end on multiples of the scheduling unit: only the window's blocks before one serve them.
        return np.arange(n) % segment >= segment - _window_blocks(spec, bs)

    @classmethod
    def hit_blocks(cls, spec, bs, unit, found, all_found, max_len):
        idx = jnp.arange(all_found.shape[0])
        nmax, segment, need = max_len // bs, unit // bs, _window_blocks(spec, bs)
        last_miss = jax.lax.cummax(jnp.where(all_found, -1, idx))
        run = idx - last_miss  # consecutive hits ending at each index
        ends = (run >= need) & (idx < nmax) & ((idx + 1) % segment == 0)
        best = jnp.max(jnp.where(ends, idx, -1))
        lead = jnp.minimum(_first_false(all_found), nmax) // segment * segment
        nblocks = jnp.where(best >= 0, best + 1, lead)
        lo = jnp.where(best >= 0, best + 1 - need, 0)
        keep = (idx >= lo) & (idx < nblocks)
        return jnp.where(keep[None, :], found, 0), nblocks * bs


class MambaManager(FullAttentionManager):
    """Mamba: one state per request; a hit is the state cached at the last unit boundary that has one."""

    @staticmethod
    def skipped_tokens(spec, num_computed):
        return num_computed - 1

    @staticmethod
    def host_reachable(spec, bs, segment, n):
        return np.arange(n) % segment == segment - 1  # the state at each segment's end

    @classmethod
    def hit_blocks(cls, spec, bs, unit, found, all_found, max_len):
        idx = jnp.arange(all_found.shape[0])
        best = jnp.max(jnp.where(all_found & (idx < max_len // bs) & ((idx + 1) % (unit // bs) == 0), idx, -1))
        return jnp.where((idx == best)[None, :], found, 0), (best + 1) * bs

    @staticmethod
    def release(row, length, retired, last_state, computed, skip, bs):
        """The skipped states and, as a second free call, the previous state block once the next is
        computed."""
        idx = jnp.arange(row.shape[0])
        sb = jnp.where(skip > 0, jnp.minimum(skip // bs, length), 0)
        freed = eviction_order(row, retired, sb)
        row = jnp.where((idx >= retired) & (idx < sb), 0, row)
        retired = jnp.where(retired < sb, sb, retired)
        ls = last_state
        drop = (ls >= 0) & (ls < cdiv(computed, bs) - 1) & (row[jnp.maximum(ls, 0)] != 0)
        second = jnp.zeros_like(row).at[0].set(jnp.where(drop, row[jnp.maximum(ls, 0)], 0))
        row = jnp.where(drop & (idx == ls), 0, row)
        return row, retired, jnp.stack([freed, second])


MANAGERS: dict[type, type[FullAttentionManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    MambaSpec: MambaManager,
}


def manager(spec) -> type[FullAttentionManager]:
    """The manager of a group of ``spec``'s layer type; ``ValueError`` for a type without one."""
    try:
        return MANAGERS[type(spec)]
    except KeyError:
        raise ValueError(f"no allocator rules for layer type {type(spec).__name__}") from None


def skipped_tokens(spec, num_computed: jax.Array) -> jax.Array:
    """Tokens whose blocks a group of ``spec`` no longer needs after ``num_computed`` tokens."""
    return manager(spec).skipped_tokens(spec, num_computed)


def release_row(layout: Layout, g: int, row, length, retired, last_state, computed):
    """Group ``g``'s table row (``i32[M]``, ``length`` entries) after dropping the blocks it no longer
    needs once ``computed`` tokens are computed (they become the null block).

    Returns (row, retired, released ``i32[2, M]``): the blocks to release as up to two free calls in
    order (the second only for a Mamba group's previous state block).
    """
    spec, bs = layout.groups[g].spec, layout.block_sizes[g]
    rules = manager(spec)
    return rules.release(row, length, retired, last_state, computed, rules.skipped_tokens(spec, computed), bs)


def allocation(layout: Layout, g: int, held, main, need, last_state):
    """New blocks of group ``g`` for a request whose table holds ``held`` entries (its hit blocks
    included) and that will hold ``main`` tokens (``need``: ``main`` capped at ``max_model_len``).

    Returns (count, table index of the first new block, table length after, ``last_state`` after).
    Attention groups take a block for every token to hold (the skipped ones are nulls already);
    a Mamba group takes one block, the state after the last block boundary, and remembers the
    previous state block (released once the next is computed).
    """
    bs = layout.block_sizes[g]
    if layout.is_mamba(g):
        required = cdiv(main, bs)
        grow = required > held
        return (grow.astype(jnp.int32), required - 1, jnp.where(grow, required, held),
                jnp.where(grow & (held > 0), held - 1, last_state))
    count = jnp.maximum(cdiv(need, bs) - held, 0)
    return count, held, held + count, last_state


def hit_blocks(spec, bs: int, unit: int, found: jax.Array, all_found: jax.Array, max_len: jax.Array):
    """Longest hit of a spec group of ``spec`` (``FullAttentionManager.hit_blocks``; its type's rule)."""
    return manager(spec).hit_blocks(spec, bs, unit, found, all_found, max_len)
