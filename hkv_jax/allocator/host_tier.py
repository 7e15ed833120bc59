"""The host tier: a second block pool in host memory behind the device prefix cache (``docs/host_tier.md``).

It holds copies of cached blocks, keyed as the device prefix cache keys them ((block hash, group)), in a
pool of its own: a ``BlockPool`` whose free queue is its LRU order (no request ever holds a host block, so
every host block is free; a store takes the queue's head, evicting that block's entry, and a hit moves
the blocks it used to the back).

What goes down is what a later hit can use, by each type's rule. Hits on the host end on multiples of the
host unit (``HostTier.unit``, a multiple of the scheduling unit), or where a prompt or a request ended: a
block goes down in the step that computes it when a hit ending on a unit multiple needs it
(``Layout.host_reachable``: every block of full attention, the window before each multiple for a sliding
window, one Mamba state per unit) or a hit on the whole prompt does; and before a request is released, what
a hit ending where its cached prefix ends needs (its last window, its state: ``released_blocks``), while
the earlier end windows of its prefix go to the LRU's head (``supersede``). So a hybrid model's host bytes
per token are what its groups' hits need, never every group's block for every token.

A step runs the two halves around the model's forward, each one gather and one scatter of pages:

- ``restore`` (before the schedule): for each waiting request, the longest hit over device and host blocks
  together by every type's hit rule (``coordinator.lookup``); the blocks only the host holds get new device
  blocks, entered in the device prefix cache as free cached blocks at the back of the free queue, so the
  schedule that follows finds them as ordinary device hits. Their pages are copied up before the forward.
- ``store`` (after the step's tokens are committed): the blocks the step computed that the tier keeps
  (``computed_blocks``) and does not hold yet take host blocks; their pages are copied down.

Writing blocks down as they are computed, not when the device evicts them, keeps the copies out of the
allocator's eviction paths (a block popped in a step is overwritten by the same step's forward), at the
cost of copying blocks the device never evicts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from hkv_jax.allocator import block_pool, free_queue, prefix_cache
from hkv_jax.allocator.coordinator import cacheable_tokens, group_blocks, group_hashes, lookup
from hkv_jax.allocator.managers import hit_blocks
from hkv_jax.allocator.state import WAITING, AllocatorState, Layout
from hkv_jax.planner import cdiv

# ``HostTier.counters`` columns.
COUNTERS = ("hit_tokens", "blocks_down", "blocks_up")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HostTier:
    """The host tier's table and pages.

    Fields:
      pool: the host block pool (``block_pool.BlockPool`` of ``num_blocks`` host blocks, block 0 unused):
        its prefix cache maps (block hash, group) to a host block, its free queue is the LRU order.
      buffers: ``word[num_blocks, page_words]`` per shared tensor of the KV cache, in host memory
        (``memory_kind``): host block ``b`` holds page ``b`` of each, as device block ``b`` does.
      counters: ``i32[3]`` since start (``COUNTERS``): tokens of hits the host served, blocks copied down,
        blocks copied up.
      superseded: ``bool[num_blocks]``: blocks holding an end window or state that a later release of the same
        prefix superseded (``supersede``): they sit at the LRU's head (behind empty blocks), the first to be
        evicted, and still serve hits until then; a hit or a store clears the flag.
      copy_up, copy_down (static): the most blocks a step copies up / down (``init_host_tier``).
      unit (static): the host unit in tokens, a multiple of the scheduling unit: as blocks are computed,
        the tier keeps what hits ending on its multiples need (``Layout.host_reachable``).
      memory_kind (static): where the buffers live (``pinned_host``; ``None``: the default memory).
      supersede (static): whether a release supersedes its prefix's earlier end windows (``supersede``).
    """

    pool: block_pool.BlockPool
    buffers: tuple[jax.Array, ...]
    counters: jax.Array
    superseded: jax.Array
    copy_up: int = field(metadata=dict(static=True), default=0)
    copy_down: int = field(metadata=dict(static=True), default=0)
    unit: int = field(metadata=dict(static=True), default=0)
    memory_kind: str | None = field(metadata=dict(static=True), default=None)
    supersede: bool = field(metadata=dict(static=True), default=True)

    @property
    def num_blocks(self) -> int:
        """Host blocks, block 0 (unused) included."""
        return self.pool.free_queue.ref_count.shape[0]


def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """``pinned_host`` where ``device`` (default: the first) lists that memory, else ``None``."""
    device = jax.devices()[0] if device is None else device
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def copy_sizes(layout: Layout, token_budget: int) -> tuple[int, int]:
    """``(copy_up, copy_down)``: the most blocks one step restores (one request's blocks in every group)
    and stores (the blocks a step's ``token_budget`` tokens fill in every group, and one part-filled block
    per request and group)."""
    up = layout.num_groups * layout.max_blocks
    down = layout.num_groups * (cdiv(token_budget, min(layout.block_sizes)) + layout.max_requests)
    return up, down


# The default host unit spans this many of the longest sliding window or attention chunk.
UNIT_WINDOWS = 8


# The default host unit with Mamba layers spans at least this many tokens: a state is as large as many
# tokens' KV, and keeping one per scheduling unit would fill the tier with states.
MAMBA_UNIT = 1024


def default_unit(layout: Layout) -> int:
    """The host unit by default: the smallest multiple of the scheduling unit that spans ``UNIT_WINDOWS`` of
    the model's longest sliding window or attention chunk, and ``MAMBA_UNIT`` tokens with Mamba layers (the
    scheduling unit without either). A sliding group then keeps one window in ``UNIT_WINDOWS`` on the host,
    a Mamba group one state per unit, besides each prompt's and request's last ones."""
    spans = [(g.spec.window or g.spec.chunk or 0) * UNIT_WINDOWS or (MAMBA_UNIT if g.spec.recurrent else 0)
             for g in layout.groups]
    unit = layout.scheduler_block_size
    return max(1, cdiv(max(spans), unit)) * unit


def host_unit(layout: Layout, unit: int = 0) -> int:
    """The host unit in tokens: ``unit``, or ``default_unit`` for 0; ``ValueError`` unless a multiple of the
    scheduling unit."""
    unit = unit or default_unit(layout)
    if unit % layout.scheduler_block_size:
        raise ValueError(f"the host unit ({unit} tokens) must be a multiple of the scheduling unit "
                         f"({layout.scheduler_block_size} tokens)")
    return unit


def init_host_tier(layout: Layout, buffers_like: tuple[jax.Array, ...], num_blocks: int, token_budget: int,
                   memory_kind: str | None = None, unit: int = 0, supersede: bool = True) -> HostTier:
    """An empty host tier of ``num_blocks`` blocks (block 0 unused) whose pages have the shape and dtype of
    ``buffers_like`` (the device cache's buffers), zero-filled in ``memory_kind``; the copy sizes come
    from ``copy_sizes``; ``unit``: the host unit in tokens (0: ``default_unit``); ``supersede``: whether
    releases supersede (``supersede``)."""
    if num_blocks < layout.num_groups + 1:
        raise ValueError(f"a host tier of {num_blocks} blocks (block 0 unused) cannot hold one block of each of "
                         f"the {layout.num_groups} groups")
    unit = host_unit(layout, unit)
    # Every array committed to the first device, as the engine's state is: a program's first call then sees
    # the placement of every later call (an uncommitted tier comes back committed from the first release, and
    # the step programs would compile again).
    device = jax.devices()[0]
    pages = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)

    def zeros(b):
        # From numpy: ``device_put`` gives the array its memory space (a jitted ``out_shardings`` does not).
        return jax.device_put(np.zeros((num_blocks,) + b.shape[1:], b.dtype), pages)

    up, down = copy_sizes(layout, token_budget)
    pool, counters, superseded = jax.device_put(
        (block_pool.init_block_pool(num_blocks, layout.num_groups), jnp.zeros(len(COUNTERS), jnp.int32),
         jnp.zeros(num_blocks, bool)), jax.sharding.SingleDeviceSharding(device))
    return HostTier(pool, tuple(zeros(b) for b in buffers_like), counters, superseded, up, down, unit,
                    memory_kind, supersede)


def _count(host: HostTier, **added) -> jax.Array:
    return host.counters + jnp.array([added.get(name, 0) for name in COUNTERS], jnp.int32)


class Copies(NamedTuple):
    """Pages to copy: ``src[i] -> dst[i]`` for ``i < count`` (``i32[K]`` each, 0 past it)."""

    src: jax.Array
    dst: jax.Array
    count: jax.Array


def _keys(layout: Layout, hashes: jax.Array) -> jax.Array:
    """``u32[G, H, 4]``: the hash keying each group's block ``i`` (``group_hashes``)."""
    H = hashes.shape[0]
    return jnp.stack([group_hashes(layout, hashes, g, H) for g in range(layout.num_groups)])


def _release_order(G: int, H: int) -> np.ndarray:
    """Flat ``[G, H]`` indices, last block index first: the order a request's blocks are freed in, so that
    its tail leaves the cache first."""
    return np.array([g * H + i for i in reversed(range(H)) for g in range(G)], np.int32)


def _found(cache: prefix_cache.PrefixCache, hashes: jax.Array) -> jax.Array:
    """``i32[G, H]``: the block ``cache`` holds per group and hash index (0: none)."""
    return prefix_cache.block_at(cache, prefix_cache.row_entries(cache, prefix_cache.find_slots(cache, hashes)).T)


def _restore_one(layout: Layout, slot, carry):
    """``restore`` for the waiting request in ``slot``; ``carry = (alloc, pool, counters, superseded, src, dst,
    used)``."""
    alloc, pool, counters, superseded, src, dst, used = carry
    G, N = layout.num_groups, layout.num_blocks
    K = src.shape[0]
    hashes = alloc.hashes[slot]
    H = hashes.shape[0]
    dev, held = _found(alloc.block_pool.prefix_cache, hashes), _found(pool.prefix_cache, hashes)
    union = jnp.where(dev > 0, dev, jnp.where(held > 0, N + held, 0))  # host blocks numbered past the device's
    hits, h, _ = lookup(layout, alloc, slot, found=union)
    _, h_dev, _ = lookup(layout, alloc, slot, found=dev)
    up = hits >= N                                                    # [G, H] by block index
    count = jnp.sum(up, dtype=jnp.int32)
    on_device = jnp.where(up, 0, hits)
    # The device hit blocks leave the free queue while the restored blocks are popped, so no pop evicts them.
    queued = jnp.sum((on_device > 0) & (alloc.block_pool.free_queue.ref_count[on_device] == 0), dtype=jnp.int32)
    ok = (count > 0) & (count <= alloc.block_pool.free_queue.num_free - queued) & (used + count <= K)

    def apply(_):
        bp = block_pool.touch(alloc.block_pool, on_device.reshape(-1))
        bp, ids = block_pool.get_new_blocks(bp, count, K)
        at = jnp.nonzero(up.reshape(-1), size=K, fill_value=G * H)[0]  # flat [G, H] positions of host hits
        lane = jnp.arange(K) < count
        new = jnp.where(lane, ids, 0)
        flat_at = jnp.minimum(at, G * H - 1)
        cache = prefix_cache.insert_many(bp.prefix_cache, new, _keys(layout, hashes).reshape(-1, 4)[flat_at],
                                         (flat_at // H).astype(jnp.int32))
        # A restored Mamba state is whole: it may serve a hit in this step (``AllocatorState.step_cached``).
        step_cached = alloc.step_cached.at[layout.step_cached_index(cache, new)].set(False, mode="drop")
        placed = jnp.zeros(G * H, jnp.int32).at[at].set(new, mode="drop")
        order = jnp.asarray(_release_order(G, H))
        bp = block_pool.free_blocks(replace(bp, prefix_cache=cache), (on_device.reshape(-1) + placed)[order])
        host_blocks = jnp.where(up, hits - N, 0).reshape(-1)
        hp = block_pool.free_blocks(block_pool.touch(pool, host_blocks), host_blocks[order])  # to the LRU's back
        pos = jnp.where(lane, used + jnp.arange(K), K)
        return (replace(alloc, block_pool=bp, step_cached=step_cached), hp, counters.at[0].add(h - h_dev),
                superseded.at[host_blocks].set(False), src.at[pos].set(host_blocks[flat_at], mode="drop"),
                dst.at[pos].set(new, mode="drop"), used + count)

    return jax.lax.cond(ok, apply, lambda _: carry, None)


def restore(layout: Layout, alloc: AllocatorState, host: HostTier, slots: jax.Array,
            mask: jax.Array) -> tuple[AllocatorState, HostTier, Copies]:
    """Bring back from the host the blocks of the waiting requests in ``slots`` (``i32[R]``; lanes where
    ``mask``, in order) that extend their prefix-cache hits: the longest hit over device and host blocks
    by every type's rule, its host-only blocks copied into new device blocks that the device prefix cache
    enters (free, at the back of the free queue) for the schedule to find. A request whose restore does not
    fit (too few free device blocks, or the step's ``copy_up`` blocks spent) keeps its device-only hit.
    Returns the allocator, the host tier (the used blocks moved to the LRU's back, hit tokens counted) and
    the pages to copy up (host -> device; ``copy_pages``)."""
    K = host.copy_up
    lanes = mask & (alloc.status[slots] == WAITING)
    order = jnp.nonzero(lanes, size=slots.shape[0], fill_value=0)[0]
    zeros = jnp.zeros(K, jnp.int32)
    carry = (alloc, host.pool, host.counters, host.superseded, zeros, zeros, jnp.int32(0))
    alloc, pool, counters, superseded, src, dst, used = jax.lax.fori_loop(
        0, jnp.sum(lanes, dtype=jnp.int32), lambda i, c: _restore_one(layout, slots[order[i]], c), carry)
    # A block restored twice in one step (a later restore popped an earlier one's block): the last copy wins.
    k = jnp.arange(K)
    last = jnp.zeros(layout.num_blocks, jnp.int32).at[jnp.where(k < used, dst, 0)].max(k)
    keep = (k < used) & (last[dst] == k)
    copies = Copies(jnp.where(keep, src, 0), jnp.where(keep, dst, 0), used)
    host = replace(host, pool=pool, counters=counters.at[2].add(jnp.sum(keep, dtype=jnp.int32)),
                   superseded=superseded)
    return alloc, host, copies


def _needed(layout: Layout, g: int, present: jax.Array, ends: jax.Array) -> jax.Array:
    """``bool[R, M]``: which of group ``g``'s blocks a hit ending at ``ends: i32[R]`` tokens needs (the group's
    hit rule: a window, a chunk, a state, or all), where ``present: bool[R, M]`` says which blocks exist."""
    spec, bs = layout.groups[g].spec, layout.block_sizes[g]

    def one(row, end):
        return hit_blocks(spec, bs, layout.scheduler_block_size, row[None].astype(jnp.int32), row, end)[0][0] > 0

    return jax.vmap(one)(present, ends)


def at_start(alloc: AllocatorState) -> tuple[jax.Array, ...]:
    """What ``computed_blocks`` compares against at the end of a step: ``num_cached``, the prefix cache's
    insertion clock, ``num_tokens`` and ``num_computed``, now."""
    return alloc.num_cached, alloc.block_pool.prefix_cache.clock, alloc.num_tokens, alloc.num_computed


def computed_blocks(layout: Layout, host: HostTier, before: tuple, alloc: AllocatorState) -> jax.Array:
    """``i32[copy_down]``: the blocks a step computed that the host tier keeps (0 past them).

    ``before = (num_cached, clock, num_tokens, num_computed)`` at the step's start (``i32[R, G]``, the
    prefix cache's insertion clock, ``i32[R]`` twice: ``at_start``). A block the step computed is a table
    entry between ``num_cached`` then and now that the cache entered since (not a hit). The tier keeps
    those that a hit ending on a multiple of the host unit needs (``Layout.host_reachable``) and, for a
    request that was prefilling (more than one token to compute), those a hit on all its known tokens
    needs: a repeated prompt hits."""
    cached_before, clock_before, tokens_before, computed_before = before
    M, G = layout.max_blocks, layout.num_groups
    idx = jnp.arange(M)
    reach = jnp.asarray(np.stack([layout.host_reachable(g, M, host.unit) for g in range(G)]))   # [G, M]
    rows = alloc.tables                                                                     # [R, G, M]
    ends = jnp.where(tokens_before - computed_before > 1, cacheable_tokens(layout, tokens_before - 1), 0)
    every = jnp.ones(rows.shape[::2], bool)                                                 # all present: [R, M]
    prompt = jnp.stack([_needed(layout, g, every, ends) for g in range(G)], axis=1)          # [R, G, M]
    cache = alloc.block_pool.prefix_cache
    new = ((idx >= cached_before[..., None]) & (idx < alloc.num_cached[..., None]) & (reach | prompt) & (rows > 0)
           & (cache.block_slot[rows] >= 0) & (cache.cached_at[rows] >= clock_before))
    at = jnp.nonzero(new.reshape(-1), size=host.copy_down, fill_value=rows.size)[0]
    return rows.reshape(-1).at[at].get(mode="fill", fill_value=0)


def _partial_groups(layout: Layout) -> list[int]:
    """The groups that do not keep every block (sliding window, chunked local, Mamba)."""
    return [g for g in range(layout.num_groups) if not layout.groups[g].spec.keeps_every_token]


def _release_ends(layout: Layout, alloc: AllocatorState) -> jax.Array:
    """``i32[R]``: where each request's cached prefix ends, cut to the scheduling unit (a hit's end)."""
    return cacheable_tokens(layout, jnp.minimum(alloc.num_computed, alloc.num_tokens))


def _request_blocks(layout: Layout, cache: prefix_cache.PrefixCache, alloc: AllocatorState, slot) -> jax.Array:
    """``i32[G, H]``: the block ``cache`` holds for each group's block index of the request in ``slot``, by
    its block hashes (0: none, or past its known tokens)."""
    hashes = alloc.hashes[slot]
    valid = jnp.arange(hashes.shape[0]) < alloc.num_tokens[slot] // layout.hash_block_size
    return group_blocks(layout, jnp.where(valid[None, :], _found(cache, hashes), 0))


def released_blocks(layout: Layout, host: HostTier, alloc: AllocatorState, go: jax.Array) -> jax.Array:
    """``i32[copy_down]``: for the requests about to be released (``go: bool[R]``), in slot order, the blocks
    a hit ending where their cached prefix ends needs, in every group that does not keep every block
    (those went down as they were computed): a sliding window's last window, a chunk, a Mamba state, found
    in the device prefix cache by the request's block hashes (so a block the request already released but
    the cache still holds counts); 0 past them. A conversation's next turn hits there."""
    K = host.copy_down
    others = _partial_groups(layout)
    if not others:
        return jnp.zeros(K, jnp.int32)
    ends = _release_ends(layout, alloc)
    order = jnp.nonzero(go, size=go.shape[0], fill_value=0)[0]

    def one(i, carry):
        out, used = carry
        slot = order[i]
        found = _request_blocks(layout, alloc.block_pool.prefix_cache, alloc, slot)
        blocks = jnp.concatenate([jnp.where(_needed(layout, g, found[g][None] > 0, ends[slot][None])[0], found[g], 0)
                                  for g in others])
        at = jnp.nonzero(blocks > 0, size=K, fill_value=blocks.shape[0])[0]
        count = jnp.sum(blocks > 0, dtype=jnp.int32)
        pos = jnp.where(jnp.arange(K) < count, used + jnp.arange(K), K)
        return out.at[pos].set(blocks.at[at].get(mode="fill", fill_value=0), mode="drop"), used + count

    return jax.lax.fori_loop(0, jnp.sum(go, dtype=jnp.int32), one, (jnp.zeros(K, jnp.int32), jnp.int32(0)))[0]


def supersede(layout: Layout, host: HostTier, alloc: AllocatorState, go: jax.Array) -> HostTier:
    """After the requests about to be released (``go: bool[R]``) stored their last windows or states
    (``released_blocks``): the host blocks that hold their prefixes' earlier end windows or states (kept
    for hits ending where an earlier prompt or request ended, not on a multiple of the unit) move to the
    LRU's head, right behind the blocks that hold nothing, flagged ``superseded``. A conversation's next
    turn hits at the new end, so these are the first to make room; until then they still serve a repeated
    earlier prompt. A block some request of ``go`` ends on stays; at most ``copy_up`` blocks a call, in
    block order. Nothing moves in a tier built with ``supersede=False``."""
    others = _partial_groups(layout)
    if not others or not host.supersede:
        return host
    N, K = host.num_blocks, host.copy_up
    ends = _release_ends(layout, alloc)
    order = jnp.nonzero(go, size=go.shape[0], fill_value=0)[0]

    def one(i, carry):
        older, last = carry                                                      # bool[N] each
        slot = order[i]
        dev = _request_blocks(layout, alloc.block_pool.prefix_cache, alloc, slot)
        held = _request_blocks(layout, host.pool.prefix_cache, alloc, slot)
        H = dev.shape[1]
        for g in others:
            present = jnp.stack([dev[g] > 0, (dev[g] > 0) | (held[g] > 0)])
            end = _needed(layout, g, present, jnp.full(2, ends[slot])).any(0)       # the last window, either way
            early = (held[g] > 0) & ~end & ~jnp.asarray(layout.host_reachable(g, H, host.unit))
            older = older.at[jnp.where(early, held[g], N)].set(True, mode="drop")
            last = last.at[jnp.where(end, held[g], N)].set(True, mode="drop")
        return older, last

    none = jnp.zeros(N, bool)
    older, last = jax.lax.fori_loop(0, jnp.sum(go, dtype=jnp.int32), one, (none, none))
    moved = older & ~last & ~host.superseded
    blocks = jnp.nonzero(moved, size=K, fill_value=0)[0].astype(jnp.int32)
    empty = host.pool.prefix_cache.block_slot < 0                                # never stored: used first
    queue = jax.lax.cond(jnp.any(moved), lambda q: free_queue.move_behind(q, empty, blocks), lambda q: q,
                         host.pool.free_queue)
    return replace(host, pool=replace(host.pool, free_queue=queue),
                   superseded=host.superseded.at[jnp.where(blocks > 0, blocks, N)].set(True, mode="drop"))


def store(layout: Layout, blocks: jax.Array, alloc: AllocatorState, host: HostTier) -> tuple[HostTier, Copies]:
    """The host side of device blocks ``blocks`` (``i32[K]``, 0: none), each cached in the device
    prefix cache: each (hash, group) the host lacks takes the LRU's head (evicting its entry) and is
    entered, one the host holds moves to the LRU's back. Returns the host tier and the pages to copy down
    (device -> host)."""
    K, G = blocks.shape[0], layout.num_groups
    cache = alloc.block_pool.prefix_cache
    entry = jnp.where(blocks > 0, cache.block_slot[blocks], -1)
    blocks = jnp.where(entry >= 0, blocks, 0)
    entry = jnp.maximum(entry, 0)
    keys, groups = cache.keys[entry // G], entry % G
    pool = host.pool
    held = jnp.where(blocks > 0, prefix_cache.lookup(pool.prefix_cache, keys, groups), 0)
    # The same (hash, group) twice among them (two requests computed one block): the first goes down.
    same = jnp.all(keys[:, None] == keys[None, :], -1) & (groups[:, None] == groups[None, :])
    first = ~jnp.any(same & jnp.tri(K, k=-1, dtype=bool) & (blocks[None, :] > 0), axis=1)
    held = jnp.where(first, held, 0)
    pool = block_pool.touch(pool, held)
    # Every host block is free but those just touched: no more new ones than that (a tiny tier).
    new = (blocks > 0) & (held == 0) & first
    new &= jnp.cumsum(new) <= pool.free_queue.num_free
    count = jnp.sum(new, dtype=jnp.int32)
    pool, ids = block_pool.get_new_blocks(pool, count, K)
    rank = jnp.cumsum(new) - 1
    dst = jnp.where(new, ids[jnp.clip(rank, 0, K - 1)], 0)
    cache_h = prefix_cache.insert_many(pool.prefix_cache, dst, keys, groups)
    pool = block_pool.free_blocks(replace(pool, prefix_cache=cache_h), held + dst)
    cache_h = pool.prefix_cache
    cache_h = jax.lax.cond(cache_h.clock > prefix_cache.CLOCK_LIMIT, prefix_cache.renumber_clock, lambda c: c, cache_h)
    order = jnp.argsort(~new, stable=True)  # the copies first
    copies = Copies(jnp.where(new, blocks, 0)[order], dst[order], count)
    superseded = host.superseded.at[held + dst].set(False)
    return replace(host, pool=replace(pool, prefix_cache=cache_h), counters=_count(host, blocks_down=count),
                   superseded=superseded), copies


def copy_pages(src_buffers: tuple[jax.Array, ...], dst_buffers: tuple[jax.Array, ...], copies: Copies,
               memory_kind: str | None, to_host: bool) -> tuple[jax.Array, ...]:
    """``dst_buffers`` with page ``copies.dst[i]`` of each set to page ``copies.src[i]`` of ``src_buffers``,
    ``i < copies.count``: one gather and one scatter per shared tensor, skipped when there is nothing to
    copy. With a host ``memory_kind`` the pages cross between memories inside the program (``to_host``:
    device -> host), and the host side's gather or scatter runs on the host (``compute_on``)."""
    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def on_host(fn, *args):
        return compute_on(compute_type="device_host", out_memory_spaces=host)(jax.jit(fn))(
            *(jax.device_put(a, host) for a in args))

    def move(width, srcs, dsts):
        src, dst = copies.src[:width], copies.dst[:width]
        live = (jnp.arange(width) < copies.count) & (dst > 0)  # never the null block
        out = []
        for s, d in zip(srcs, dsts):
            at = jnp.where(live, dst, d.shape[0])
            if memory_kind is None:
                out.append(d.at[at].set(s[src], mode="drop"))
            elif to_host:
                out.append(on_host(lambda h, p, i: h.at[i].set(p, mode="drop"), d, s[src], at))
            else:
                out.append(d.at[at].set(jax.device_put(on_host(lambda h, i: h[i], s, src), device), mode="drop"))
        return tuple(out)

    return by_count(copies.count, copies.src.shape[0], move, src_buffers, dst_buffers)


# Most steps copy a few blocks (a decode step caches a block now and then): they run programs this wide.
SMALL = 8


def by_count(count, width: int, fn, *args):
    """``fn(w, *args)`` for the smallest ``w`` of ``SMALL`` and ``width`` that holds ``count`` items; the last
    of ``args`` as it is for a ``count`` of 0. Each width's work is compiled once, as a branch."""
    widths = sorted({min(SMALL, width), width})
    branches = [lambda *a: a[-1]] + [lambda *a, w=w: fn(w, *a) for w in widths]
    index = jnp.where(count == 0, 0, 1 + jnp.sum(count > jnp.array(widths[:-1], jnp.int32)))
    return jax.lax.switch(index, branches, *args)


def host_usage(layout: Layout, host: HostTier) -> dict:
    """What the host tier holds (read back): blocks (block 0 left out), blocks cached per group, those of them
    superseded, and the counters (``COUNTERS``)."""
    slot, superseded = jax.device_get((host.pool.prefix_cache.block_slot, host.superseded))
    per_group = np.bincount(slot[slot >= 0] % layout.num_groups, minlength=layout.num_groups)
    return {"blocks": host.num_blocks - 1, "cached_per_group": per_group.tolist(),
            "superseded": int(np.sum(superseded & (slot >= 0))),
            **dict(zip(COUNTERS, np.asarray(host.counters).tolist()))}


def available_host_bytes() -> int:
    """Host memory free for new allocations (``MemAvailable`` on Linux, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_blocks(host_bytes: int, block_bytes: int, num_groups: int) -> int:
    """Host blocks (block 0 included) that ``host_bytes`` of host memory hold, blocks of ``block_bytes``
    (a page of every shared tensor); 0 for ``host_bytes`` 0. ``ValueError`` for more than the host's free
    memory or fewer bytes than one block of each of ``num_groups`` groups."""
    if host_bytes == 0:
        return 0
    free = available_host_bytes()
    if host_bytes > free:
        raise ValueError(f"host_cache_bytes {host_bytes:,} is more than the {free:,} bytes of host memory free")
    blocks = host_bytes // block_bytes
    if blocks < num_groups:
        raise ValueError(f"host_cache_bytes {host_bytes:,} holds {blocks} blocks of {block_bytes:,} bytes: the host "
                         f"tier needs one block of each of the {num_groups} groups, {num_groups * block_bytes:,} bytes")
    return blocks + 1


def bytes_per_token(layout: Layout, block_bytes: int, unit: int = 0) -> tuple[list[float], list[float]]:
    """Host bytes per cached token of each allocator group over a long prefix, ``(ours, naive)``: ours keep
    what hits ending on multiples of ``unit`` tokens (0: ``default_unit``) need (``Layout.host_reachable``:
    a share of the group's blocks, ``block_bytes`` each); a naive tier keeps every group's block for every
    token. A request's last window or state, which the tier also keeps, is left out: it does not grow with
    the prefix."""
    unit = host_unit(layout, unit)
    ours, naive = [], []
    for g in range(layout.num_groups):
        bs = layout.block_sizes[g]
        share = float(np.mean(layout.host_reachable(g, 64 * (unit // bs), unit)))
        ours.append(share * block_bytes / bs)
        naive.append(block_bytes / bs)
    return ours, naive


def capacity(layout: Layout, block_bytes: int, host_bytes: int, unit: int = 0) -> dict:
    """What ``host_bytes`` of host tier hold (``hkv plan --host-cache``): the unit, the blocks, each KV cache
    group's host bytes per cached token, and the cached tokens over all groups, against a naive tier that
    keeps every group's block for every token (``bytes_per_token``)."""
    unit = host_unit(layout, unit)
    ours, naive = bytes_per_token(layout, block_bytes, unit)
    groups = [{"group": i, "kind": layout.groups[p[0]].spec.kind,
               "bytes_per_token": sum(ours[g] for g in p), "naive_bytes_per_token": sum(naive[g] for g in p)}
              for i, p in enumerate(layout.parts)]
    return {"host_bytes": host_bytes, "unit_tokens": unit, "blocks": host_bytes // block_bytes, "groups": groups,
            "bytes_per_token": sum(ours), "naive_bytes_per_token": sum(naive),
            "tokens": int(host_bytes // sum(ours)), "naive_tokens": int(host_bytes // sum(naive))}
