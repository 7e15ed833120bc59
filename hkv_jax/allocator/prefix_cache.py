"""The device-resident prefix cache: (block hash, group id) -> block, as arrays.

An open-addressing hash table (linear probing, tombstones) maps a key to the
*oldest* block cached under it; further blocks cached under the same key
(two requests computed the same block) are counted in ``dups`` and remember
their slot, so that evicting the oldest promotes the next oldest, as vLLM's
map of blocks per hash does. Every operation is a pure function over the
``PrefixCache`` pytree; probes are ``lax.while_loop``s bounded by the table
size, lookups ``vmap`` over a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hkv_jax.allocator.pool import running_count

EMPTY, TOMBSTONE = -1, -2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PrefixCache:
    """Prefix-cache table of ``num_slots`` slots for a pool of ``num_blocks`` blocks.

    Fields:
      keys: ``u32[num_slots, 4]`` block hash of each slot.
      group: ``i32[num_slots]`` KV cache group of the slot's key; ``EMPTY`` or ``TOMBSTONE``.
      block: ``i32[num_slots]`` the oldest block cached under the key.
      dups: ``i32[num_slots]`` how many more blocks are cached under the key (0 at empty and
        tombstone slots: a key leaves only when it holds no duplicate).
      block_slot: ``i32[num_blocks]`` slot of the key a block is cached under; -1 when not cached.
      cached_at: ``i32[num_blocks]`` insertion clock of each cached block (oldest first).
      hit: ``bool[num_blocks]`` the block served a prefix hit since it was cached (a shared prefix:
        window-aware eviction keeps it at the back of the free queue).
      clock: ``i32[]`` next insertion time.
    """

    keys: jax.Array
    group: jax.Array
    block: jax.Array
    dups: jax.Array
    block_slot: jax.Array
    cached_at: jax.Array
    hit: jax.Array
    clock: jax.Array


def init_prefix_cache(num_blocks: int, num_slots: int | None = None) -> PrefixCache:
    """An empty cache; ``num_slots`` (a power of two) defaults to the first >= 2 x num_blocks."""
    if num_slots is None:
        num_slots = 1 << max(1, (2 * num_blocks - 1).bit_length())
    if num_slots & (num_slots - 1) or num_slots < num_blocks:
        raise ValueError(f"num_slots must be a power of two >= num_blocks, got {num_slots}")
    return PrefixCache(
        keys=jnp.zeros((num_slots, 4), jnp.uint32),
        group=jnp.full(num_slots, EMPTY, jnp.int32),
        block=jnp.zeros(num_slots, jnp.int32),
        dups=jnp.zeros(num_slots, jnp.int32),
        block_slot=jnp.full(num_blocks, -1, jnp.int32),
        cached_at=jnp.zeros(num_blocks, jnp.int32),
        hit=jnp.zeros(num_blocks, bool),
        clock=jnp.int32(0),
    )


def _home(cache: PrefixCache, key: jax.Array, group: jax.Array) -> jax.Array:
    mask = cache.group.shape[0] - 1
    mixed = key[0] ^ (key[1] * jnp.uint32(0x9E3779B1)) ^ (group.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B))
    return (mixed & jnp.uint32(mask)).astype(jnp.int32)


def _probe(cache: PrefixCache, key: jax.Array, group: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(slot holding the key or -1, first free slot on the probe path: tombstone or empty, or -1)."""
    size = cache.group.shape[0]
    mask = size - 1

    def cond(c):
        i, slot, found, free = c
        return (i < size) & (found < 0) & (cache.group[slot] != EMPTY)

    def body(c):
        i, slot, found, free = c
        hit = (cache.group[slot] == group) & jnp.all(cache.keys[slot] == key)
        found = jnp.where(hit, slot, found)
        free = jnp.where((free < 0) & (cache.group[slot] == TOMBSTONE), slot, free)
        return i + 1, (slot + 1) & mask, found, free

    i, slot, found, free = jax.lax.while_loop(cond, body, (jnp.int32(0), _home(cache, key, group), jnp.int32(-1), jnp.int32(-1)))
    free = jnp.where((free < 0) & (i < size) & (found < 0), slot, free)
    return found, free


def find(cache: PrefixCache, keys: jax.Array, groups: jax.Array) -> jax.Array:
    """Slot holding each (``keys[i]``, ``groups[i]``), -1 when not cached.

    ``keys`` is ``u32[..., 4]``, ``groups`` ``i32[...]``; batch dims are vmapped.
    """
    flat_k, flat_g = keys.reshape(-1, 4), groups.reshape(-1)
    return jax.vmap(lambda k, g: _probe(cache, k, g)[0])(flat_k, flat_g).reshape(groups.shape)


def block_at(cache: PrefixCache, slots: jax.Array) -> jax.Array:
    """The (oldest) block cached at each of ``slots`` (from ``find``), 0 (the null block) for -1."""
    return jnp.where(slots >= 0, cache.block[jnp.maximum(slots, 0)], 0)


def lookup(cache: PrefixCache, keys: jax.Array, groups: jax.Array) -> jax.Array:
    """Block cached under each (``keys[i]``, ``groups[i]``), 0 (the null block) when none (shapes as ``find``)."""
    return block_at(cache, find(cache, keys, groups))


def _set(arr: jax.Array, i, value, when) -> jax.Array:
    """``arr.at[i].set(value)`` if ``when``, as an O(1) update."""
    return arr.at[i].set(jnp.where(when, value, arr[i]))


def insert(cache: PrefixCache, block: jax.Array, key: jax.Array, group: jax.Array) -> PrefixCache:
    """Cache ``block`` (not cached now, > 0) under (``key``, ``group``); a no-op for block 0."""
    found, free = _probe(cache, key, group)
    slot = jnp.where(found >= 0, found, free)
    do = (block > 0) & (slot >= 0)
    s = jnp.where(do, slot, 0)
    new_key = do & (found < 0)
    b = jnp.maximum(block, 0)
    return PrefixCache(
        keys=_set(cache.keys, s, key, new_key),
        group=_set(cache.group, s, group, new_key),
        block=_set(cache.block, s, block, new_key),
        dups=_set(cache.dups, s, jnp.where(new_key, 0, cache.dups[s] + 1), do),
        block_slot=_set(cache.block_slot, b, s, do),
        cached_at=_set(cache.cached_at, b, cache.clock, do),
        hit=_set(cache.hit, b, False, do),
        clock=cache.clock + do.astype(jnp.int32),
    )


def evict(cache: PrefixCache, block: jax.Array) -> PrefixCache:
    """Drop ``block``'s cache entry, if it has one; the next oldest duplicate takes over the key."""
    b = jnp.maximum(block, 0)
    s = cache.block_slot[b]
    has = (block > 0) & (s >= 0)
    s0 = jnp.maximum(s, 0)
    is_head = has & (cache.block[s0] == block)
    has_dups = cache.dups[s0] > 0

    def successor(_):
        # Only when the oldest of several duplicates leaves: one O(num_blocks) search.
        others = (cache.block_slot == s) & (jnp.arange(cache.block_slot.shape[0]) != block)
        return jnp.argmin(jnp.where(others, cache.cached_at, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)

    promote = is_head & has_dups
    nxt = jax.lax.cond(promote, successor, lambda _: jnp.int32(0), None)
    return replace(
        cache,
        group=_set(cache.group, s0, TOMBSTONE, is_head & ~has_dups),
        block=_set(cache.block, s0, nxt, promote),
        dups=_set(cache.dups, s0, cache.dups[s0] - 1, has & has_dups),
        block_slot=_set(cache.block_slot, b, -1, has),
    )


def is_cached(cache: PrefixCache) -> jax.Array:
    """``bool[num_blocks]``: blocks that hold a cache entry (they go to the back of the free queue)."""
    return cache.block_slot >= 0


def reset(cache: PrefixCache) -> PrefixCache:
    """Drop every entry (``reset_prefix_cache``; the caller checks that no block is held)."""
    return init_prefix_cache(cache.block_slot.shape[0], cache.group.shape[0])


# --- batched updates (same results as the one-at-a-time functions, in the given order) --------


def needs_promotion(cache: PrefixCache, blocks: jax.Array) -> jax.Array:
    """``bool[K]``: which ids of ``blocks`` are cached under a key that also holds other blocks."""
    b = jnp.maximum(blocks, 0)
    s = cache.block_slot[b]
    return (blocks > 0) & (s >= 0) & (cache.dups[jnp.maximum(s, 0)] > 0)


def evict_alone(cache: PrefixCache, blocks: jax.Array) -> PrefixCache:
    """``evict`` each id of ``blocks: i32[K]`` that is the only block under its key, in one update
    (such keys are independent of every other block's). Other ids are left alone."""
    n, size = cache.block_slot.shape[0], cache.group.shape[0]
    b = jnp.maximum(blocks, 0)
    s = cache.block_slot[b]
    alone = (blocks > 0) & (s >= 0) & ~needs_promotion(cache, blocks)
    return replace(
        cache,
        group=cache.group.at[jnp.where(alone, s, size)].set(TOMBSTONE, mode="drop"),
        block_slot=cache.block_slot.at[jnp.where(alone, b, n)].set(-1, mode="drop"),
    )


def evict_many(cache: PrefixCache, blocks: jax.Array) -> PrefixCache:
    """``evict`` each id of ``blocks: i32[K]`` in order (0 entries are skipped; ids distinct).

    Blocks alone under their key go in one vectorised update; blocks whose key
    has duplicates go through ``evict`` one by one, in order.
    """
    rest = needs_promotion(cache, blocks)
    cache = evict_alone(cache, blocks)
    order = jnp.nonzero(rest, size=blocks.shape[0], fill_value=0)[0]
    return jax.lax.fori_loop(0, jnp.sum(rest), lambda i, c: evict(c, blocks[order[i]]), cache)


def insert_many(cache: PrefixCache, blocks: jax.Array, keys: jax.Array, groups: jax.Array,
                claims: str = "auto", found: jax.Array | None = None) -> PrefixCache:
    """``insert`` each non-null ``blocks[i]`` (not cached now; ids distinct) under (``keys[i]``, ``groups[i]``), in order.

    ``blocks: i32[K]``, ``keys: u32[K, 4]``, ``groups: i32[K]``. Keys already in
    the table gain a duplicate; the others claim slots in rounds: every pending
    key looks at its probe slot, joins it if an earlier key of the batch
    claimed it for the same key, claims it if free (the earliest claimant
    wins; the others look again next round) or moves on. The rounds touch only
    the batch's claims, so the table is written once, after them. Slots may differ
    from one-by-one inserts, but every key stays reachable from its home slot,
    and which block a lookup returns (the oldest) and the duplicate counts are
    the same. ``claims`` (static): ``table`` keeps the claims in a table-sized
    array, ``sorted`` in the batch's own sorted slots, ``auto`` picks by size.
    ``found: i32[K]``, optional: each key's slot in ``cache`` now (``find``), when the caller has it
    (a prefill looked the keys up): saves a probe per key.
    """
    K, size, n = blocks.shape[0], cache.group.shape[0], cache.block_slot.shape[0]
    mask = size - 1
    do = blocks > 0
    rank = running_count(do) - 1                                         # insertion order among the real ones
    if found is None:
        found = find(cache, keys, groups)
    idx = jnp.arange(K, dtype=jnp.int32)
    home = jax.vmap(lambda k, g: _home(cache, k, g))(keys, groups)
    big = jnp.iinfo(jnp.int32).max
    # Claims of this batch: a claim array over the table (filled once, then O(K) per round) unless the
    # batch is tiny next to the table; else the batch's own claimed slots, sorted each round (O(K log K)
    # per round, no table-sized array). A sort per round costs more than a fill of 128 slots per key.
    if claims not in ("auto", "table", "sorted"):
        raise ValueError(f"claims must be auto, table or sorted, got {claims!r}")
    by_table = claims == "table" or (claims == "auto" and K * 128 >= size)

    def claims_at(claimed, probe):
        """Owner (batch index) of each probe slot, ``big`` if unclaimed; with table claims, -1 where the
        table holds a key (one gather answers both)."""
        if by_table:
            return claimed[probe]
        order = jnp.argsort(claimed)
        srt = claimed[order]
        at = jnp.minimum(jnp.searchsorted(srt, probe), K - 1)
        return jnp.where(srt[at] == probe, order[at], big)

    def contest(claimed, free, probe, lane):
        """The earliest free key at each probe slot wins it: (claimed, won)."""
        if by_table:
            claimed = claimed.at[jnp.where(free, probe, size)].min(lane, mode="drop")
            return claimed, free & (claimed[probe] == lane)
        keyed = jnp.where(free, probe, big)
        order = jnp.argsort(keyed, stable=True)                        # equal slots: batch order
        srt = keyed[order]
        first = jnp.concatenate([jnp.ones(1, bool), srt[1:] != srt[:-1]]) & (srt < big)
        won = jnp.zeros(K, bool).at[order].set(first)
        return jnp.where(won, probe, claimed), won

    def body(c, lane, lane_keys, lane_groups):
        """One round for the batch keys ``lane`` (per-lane ``pending``, ``probe``, ``slot_of``)."""
        claimed, pending, probe, slot_of = c
        o = claims_at(claimed, probe)
        taken = o < 0 if by_table else cache.group[probe] >= 0
        is_claimed = (o >= 0) & (o < big)
        oc = jnp.clip(o, 0, K - 1)
        same = is_claimed & (groups[oc] == lane_groups) & jnp.all(keys[oc] == lane_keys, axis=-1)
        joined = pending & same
        free = pending & ~taken & ~is_claimed
        claimed, won = contest(claimed, free, probe, lane)
        slot_of = jnp.where(won | joined, probe, slot_of)
        moved = pending & (taken | (is_claimed & ~same))
        return claimed, pending & ~(won | joined), jnp.where(moved, (probe + 1) & mask, probe), slot_of

    init = jnp.where(cache.group >= 0, -1, big) if by_table else jnp.full(K, big, jnp.int32)
    c = (init, do & (found < 0), home, found)
    # Each round settles most pending keys (on an empty table: 89% of them, then about 70%), so with table
    # claims the rounds run over fewer and fewer lanes: at each level, until the pending keys fit the next
    # level's lanes (an eighth), then over those only. This halves the lane-rounds of a big batch. A small
    # batch (sorted claims) runs all its rounds over every lane.
    lane = idx
    caps = [K]
    while by_table and caps[-1] // 8 >= 64:
        caps.append(caps[-1] // 8)
    for level, cap in enumerate(caps):
        nxt = caps[level + 1] if level + 1 < len(caps) else 0
        if level == 0:
            lane_keys, lane_groups = keys, groups
        else:
            lane_c = jnp.minimum(lane, K - 1)
            lane_keys, lane_groups = keys[lane_c], groups[lane_c]
        c = jax.lax.while_loop(lambda c: jnp.sum(c[1]) > nxt, lambda c: body(c, lane, lane_keys, lane_groups), c)
        claimed, pending, probe, slot_c = c
        slot_of = slot_c if level == 0 else slot_of.at[lane].set(slot_c, mode="drop")  # padding lanes drop
        if nxt:
            sel = jnp.nonzero(pending, size=nxt, fill_value=cap)[0]
            sel_c = jnp.minimum(sel, cap - 1)
            lane = jnp.where(sel < cap, lane[sel_c], K).astype(jnp.int32)
            c = (claimed, pending[sel_c] & (sel < cap), probe[sel_c], slot_c[sel_c])
    owner = claims_at(claimed, jnp.maximum(slot_of, 0))
    opened = do & (found < 0) & (owner == idx)                        # first block under a new key
    tgt = jnp.where(opened, slot_of, size)
    dup = do & ~opened                                                   # every other block joins a key
    return replace(
        cache,
        keys=cache.keys.at[tgt].set(keys, mode="drop"),
        group=cache.group.at[tgt].set(groups, mode="drop"),
        block=cache.block.at[tgt].set(blocks, mode="drop"),
        dups=cache.dups.at[jnp.where(dup, slot_of, size)].add(1, mode="drop"),  # an opened slot's is 0
        block_slot=cache.block_slot.at[jnp.where(do, blocks, n)].set(slot_of, mode="drop"),
        cached_at=cache.cached_at.at[jnp.where(do, blocks, n)].set(cache.clock + rank, mode="drop"),
        hit=cache.hit.at[jnp.where(do, blocks, n)].set(False, mode="drop"),
        clock=cache.clock + jnp.sum(do, dtype=jnp.int32),
    )
