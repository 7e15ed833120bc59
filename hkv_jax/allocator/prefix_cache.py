"""The device-resident prefix cache: (block hash, group id) -> block, as arrays.

An open-addressing hash table (linear probing, tombstones) of block hashes; a
slot holds one hash and a row of ``G`` entries, one per KV cache group, each
the *oldest* block cached under (hash, group). All groups of a model hash the
same tokens, so one probe serves every group and a prefill's claims and writes
go per hash row, not per (hash, group) key. Further blocks cached under the
same entry (two requests computed the same block) are counted in ``dups`` and
remember their entry, so that evicting the oldest promotes the next oldest, as
vLLM's map of blocks per hash does. Every operation is a pure function over the
``PrefixCache`` pytree; probes are ``lax.while_loop``s bounded by the table
size, lookups ``vmap`` over a batch. An *entry id* is ``slot * G + group``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hkv_jax.allocator.free_queue import running_count

EMPTY, TOMBSTONE = -1, 0  # values of ``used``; a live slot counts its entries (> 0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PrefixCache:
    """Prefix-cache table of ``num_slots`` slots x ``G`` groups for a pool of ``num_blocks`` blocks.

    Fields:
      keys: ``u32[num_slots, 4]`` block hash of each slot.
      used: ``i32[num_slots]`` how many groups have an entry in the slot; ``EMPTY`` (-1) for a slot
        never used, ``TOMBSTONE`` (0) for one whose entries all left (probes walk past it).
      block: ``i32[num_slots, G]`` the oldest block cached under (slot's hash, group); 0 for none
        (every entry of a free slot is 0).
      dups: ``i32[num_slots, G]`` how many more blocks are cached under the entry (0 at empty entries:
        an entry leaves only when it holds no duplicate).
      block_slot: ``i32[num_blocks]`` entry id (``slot * G + group``) a block is cached under; -1 when
        not cached.
      cached_at: ``i32[num_blocks]`` insertion time of each cached block (orders duplicates: the oldest
        serves hits); only its order among cached blocks matters (``renumber_clock``).
      hit: ``bool[num_blocks]`` the block served a prefix hit since it was cached (a shared prefix:
        window-aware eviction keeps it at the back of the free queue).
      clock: ``i32[]`` next insertion time.
    """

    keys: jax.Array
    used: jax.Array
    block: jax.Array
    dups: jax.Array
    block_slot: jax.Array
    cached_at: jax.Array
    hit: jax.Array
    clock: jax.Array

    @property
    def num_groups(self) -> int:
        """G, the entries per slot."""
        return self.block.shape[1]


def init_prefix_cache(num_blocks: int, num_slots: int | None = None, num_groups: int = 1) -> PrefixCache:
    """An empty cache for ``num_groups`` KV cache groups; ``num_slots`` (a power of two) defaults to
    the first >= 2 x num_blocks (every cached block may carry a hash of its own)."""
    if num_slots is None:
        num_slots = 1 << max(1, (2 * num_blocks - 1).bit_length())
    if num_slots & (num_slots - 1) or num_slots < num_blocks:
        raise ValueError(f"num_slots must be a power of two >= num_blocks, got {num_slots}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    return PrefixCache(
        keys=jnp.zeros((num_slots, 4), jnp.uint32),
        used=jnp.full(num_slots, EMPTY, jnp.int32),
        block=jnp.zeros((num_slots, num_groups), jnp.int32),
        dups=jnp.zeros((num_slots, num_groups), jnp.int32),
        block_slot=jnp.full(num_blocks, -1, jnp.int32),
        cached_at=jnp.zeros(num_blocks, jnp.int32),
        hit=jnp.zeros(num_blocks, bool),
        clock=jnp.int32(0),
    )


def _home(cache: PrefixCache, key: jax.Array) -> jax.Array:
    mask = cache.used.shape[0] - 1
    mixed = key[0] ^ (key[1] * jnp.uint32(0x9E3779B1))
    return (mixed & jnp.uint32(mask)).astype(jnp.int32)


def _probe(cache: PrefixCache, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(slot holding the hash or -1, first free slot on the probe path: tombstone or empty, or -1)."""
    size = cache.used.shape[0]
    mask = size - 1

    def cond(c):
        i, slot, found, free = c
        return (i < size) & (found < 0) & (cache.used[slot] != EMPTY)

    def body(c):
        i, slot, found, free = c
        hit = (cache.used[slot] > 0) & jnp.all(cache.keys[slot] == key)
        found = jnp.where(hit, slot, found)
        free = jnp.where((free < 0) & (cache.used[slot] == TOMBSTONE), slot, free)
        return i + 1, (slot + 1) & mask, found, free

    i, slot, found, free = jax.lax.while_loop(
        cond, body, (jnp.int32(0), _home(cache, key), jnp.int32(-1), jnp.int32(-1))
    )
    free = jnp.where((free < 0) & (i < size) & (found < 0), slot, free)
    return found, free


def find_slots(cache: PrefixCache, keys: jax.Array) -> jax.Array:
    """Slot holding each hash of ``keys: u32[..., 4]``, -1 when none (``i32[...]``; batch dims vmapped)."""
    flat = keys.reshape(-1, 4)
    return jax.vmap(lambda k: _probe(cache, k)[0])(flat).reshape(keys.shape[:-1])


def row_entries(cache: PrefixCache, slots: jax.Array) -> jax.Array:
    """``i32[..., G]``: entry id of every group at each of ``slots`` (``find_slots``), -1 where the
    group has no block (or the slot is -1). One row read per slot."""
    G = cache.num_groups
    rows = cache.block[jnp.maximum(slots, 0)]
    ids = slots[..., None] * G + jnp.arange(G, dtype=jnp.int32)
    return jnp.where((slots[..., None] >= 0) & (rows > 0), ids, -1)


def find(cache: PrefixCache, keys: jax.Array, groups: jax.Array) -> jax.Array:
    """Entry id of each (``keys[i]``, ``groups[i]``), -1 when not cached.

    ``keys`` is ``u32[..., 4]``, ``groups`` ``i32[...]``; batch dims are vmapped.
    """
    slots = find_slots(cache, keys)
    ids = slots * cache.num_groups + groups
    return jnp.where((slots >= 0) & (block_at(cache, jnp.where(slots >= 0, ids, -1)) > 0), ids, -1)


def block_at(cache: PrefixCache, entries: jax.Array) -> jax.Array:
    """The (oldest) block cached at each of ``entries`` (from ``find``), 0 (the null block) for -1."""
    return jnp.where(entries >= 0, cache.block.reshape(-1)[jnp.maximum(entries, 0)], 0)


def lookup(cache: PrefixCache, keys: jax.Array, groups: jax.Array) -> jax.Array:
    """Block cached under each (``keys[i]``, ``groups[i]``), 0 (the null block) when none (shapes as ``find``)."""
    return block_at(cache, find(cache, keys, groups))


def _set(arr: jax.Array, i, value, when) -> jax.Array:
    """``arr.at[i].set(value)`` if ``when``, as an O(1) update."""
    return arr.at[i].set(jnp.where(when, value, arr[i]))


def insert(cache: PrefixCache, block: jax.Array, key: jax.Array, group: jax.Array) -> PrefixCache:
    """Cache ``block`` (not cached now, > 0) under (``key``, ``group``); a no-op for block 0."""
    G = cache.num_groups
    found, free = _probe(cache, key)
    slot = jnp.where(found >= 0, found, free)
    do = (block > 0) & (slot >= 0)
    s = jnp.where(do, slot, 0)
    e = s * G + group
    flat_block, flat_dups = cache.block.reshape(-1), cache.dups.reshape(-1)
    opens = do & (flat_block[e] == 0)  # the first block under (hash, group)
    new_slot = do & (found < 0)
    b = jnp.maximum(block, 0)
    return PrefixCache(
        keys=_set(cache.keys, s, key, new_slot),
        used=_set(cache.used, s, jnp.where(new_slot, 1, cache.used[s] + 1), opens),
        block=_set(flat_block, e, block, opens).reshape(cache.block.shape),
        dups=_set(flat_dups, e, jnp.where(opens, 0, flat_dups[e] + 1), do).reshape(cache.dups.shape),
        block_slot=_set(cache.block_slot, b, e, do),
        cached_at=_set(cache.cached_at, b, cache.clock, do),
        hit=_set(cache.hit, b, False, do),
        clock=cache.clock + do.astype(jnp.int32),
    )


def evict(cache: PrefixCache, block: jax.Array) -> PrefixCache:
    """Drop ``block``'s cache entry, if it has one; the next oldest duplicate takes over the entry."""
    G = cache.num_groups
    flat_block, flat_dups = cache.block.reshape(-1), cache.dups.reshape(-1)
    b = jnp.maximum(block, 0)
    e = cache.block_slot[b]
    has = (block > 0) & (e >= 0)
    e0 = jnp.maximum(e, 0)
    is_head = has & (flat_block[e0] == block)
    has_dups = flat_dups[e0] > 0

    def successor(_):
        # Only when the oldest of several duplicates leaves: one O(num_blocks) search.
        others = (cache.block_slot == e) & (jnp.arange(cache.block_slot.shape[0]) != block)
        return jnp.argmin(jnp.where(others, cache.cached_at, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)

    promote = is_head & has_dups
    leaves = is_head & ~has_dups  # the entry empties; the slot turns into a tombstone with its last entry
    nxt = jax.lax.cond(promote, successor, lambda _: jnp.int32(0), None)
    return replace(
        cache,
        used=_set(cache.used, e0 // G, cache.used[e0 // G] - 1, leaves),
        block=_set(flat_block, e0, nxt, is_head).reshape(cache.block.shape),
        dups=_set(flat_dups, e0, flat_dups[e0] - 1, has & has_dups).reshape(cache.dups.shape),
        block_slot=_set(cache.block_slot, b, -1, has),
    )


# The clock is renumbered past this (``renumber_clock``), far from int32's end: a step inserts < 2^30 blocks.
CLOCK_LIMIT = 1 << 30


def renumber_clock(cache: PrefixCache) -> PrefixCache:
    """The same cache with insertion times renumbered ``0 .. cached - 1`` in their order (and the clock
    after them): the clock only grows, so a long-running server calls this (through
    ``requests.new_step``) before it nears int32's end. O(num_blocks log num_blocks), rarely."""
    cached = cache.block_slot >= 0
    n = cached.shape[0]
    order = jnp.argsort(jnp.where(cached, cache.cached_at, jnp.iinfo(jnp.int32).max), stable=True)
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return replace(cache, cached_at=jnp.where(cached, rank, 0), clock=jnp.sum(cached, dtype=jnp.int32))


def is_cached(cache: PrefixCache) -> jax.Array:
    """``bool[num_blocks]``: blocks that hold a cache entry (they go to the back of the free queue)."""
    return cache.block_slot >= 0


def reset(cache: PrefixCache) -> PrefixCache:
    """Drop every entry (``reset_prefix_cache``; the caller checks that no block is held)."""
    return init_prefix_cache(cache.block_slot.shape[0], cache.used.shape[0], cache.num_groups)


# --- batched updates (same results as the one-at-a-time functions, in the given order) --------


def needs_promotion(cache: PrefixCache, blocks: jax.Array) -> jax.Array:
    """``bool[K]``: which ids of ``blocks`` are cached under an entry that also holds other blocks."""
    b = jnp.maximum(blocks, 0)
    e = cache.block_slot[b]
    return (blocks > 0) & (e >= 0) & (cache.dups.reshape(-1)[jnp.maximum(e, 0)] > 0)


def evict_alone(cache: PrefixCache, blocks: jax.Array) -> PrefixCache:
    """``evict`` each id of ``blocks: i32[K]`` that is the only block under its entry, in one update
    (such entries are independent of every other block's). Other ids are left alone."""
    n, size, G = cache.block_slot.shape[0], cache.used.shape[0], cache.num_groups
    b = jnp.maximum(blocks, 0)
    e = cache.block_slot[b]
    alone = (blocks > 0) & (e >= 0) & ~needs_promotion(cache, blocks)
    return replace(
        cache,
        # A slot whose last entry leaves drops to 0 used: a tombstone.
        used=cache.used.at[jnp.where(alone, e // G, size)].add(-1, mode="drop"),
        block=cache.block.reshape(-1).at[jnp.where(alone, e, size * G)].set(0, mode="drop").reshape(size, G),
        block_slot=cache.block_slot.at[jnp.where(alone, b, n)].set(-1, mode="drop"),
    )


def evict_many(cache: PrefixCache, blocks: jax.Array) -> PrefixCache:
    """``evict`` each id of ``blocks: i32[K]`` in order (0 entries are skipped; ids distinct).

    Blocks alone under their entry go in one vectorised update; blocks whose entry
    has duplicates go through ``evict`` one by one, in order.
    """
    rest = needs_promotion(cache, blocks)
    cache = evict_alone(cache, blocks)
    order = jnp.nonzero(rest, size=blocks.shape[0], fill_value=0)[0]
    return jax.lax.fori_loop(0, jnp.sum(rest), lambda i, c: evict(c, blocks[order[i]]), cache)


def insert_many(cache: PrefixCache, blocks: jax.Array, keys: jax.Array, groups: jax.Array,
                claims: str = "auto") -> PrefixCache:
    """``insert`` each non-null ``blocks[i]`` (not cached now; ids distinct) under (``keys[i]``, ``groups[i]``),
    in order.

    ``blocks: i32[K]``, ``keys: u32[K, 4]``, ``groups: i32[K]``: ``insert_rows`` with one block per row.
    """
    G = cache.num_groups
    rows = jnp.where(jnp.arange(G, dtype=jnp.int32)[None, :] == groups[:, None], blocks[:, None], 0)
    return insert_rows(cache, rows, keys, claims)


def insert_rows(cache: PrefixCache, blocks: jax.Array, keys: jax.Array, claims: str = "auto",
                found: jax.Array | None = None) -> PrefixCache:
    """``insert`` each non-null ``blocks[k, g]`` (not cached now; ids distinct) under (``keys[k]``, ``g``),
    in row-major order.

    ``blocks: i32[K, G]``, ``keys: u32[K, 4]``. Hashes already in the table fill
    entries in their slot; the other rows claim slots in rounds: every pending
    row looks at its probe slot, joins it if an earlier row of the batch claimed
    it for the same hash, claims it if free (the earliest claimant wins; the
    others look again next round) or moves on. The rounds touch only the
    batch's claims, so the table is written once, after them, a row at a time.
    Slots may differ from one-by-one inserts, but every hash stays reachable from
    its home slot, and which block a lookup returns (the oldest) and the duplicate
    counts are the same. ``claims`` (static): ``table`` keeps the claims in a
    table-sized array, ``sorted`` in the batch's own sorted slots, ``auto`` picks
    by size. ``found: i32[K]``, optional: each row's slot in ``cache`` now
    (``find_slots``), when the caller has it (a prefill looked the hashes up):
    saves a probe per row.
    """
    K, G = blocks.shape
    size, n = cache.used.shape[0], cache.block_slot.shape[0]
    mask = size - 1
    do = blocks > 0                                                       # [K, G]
    row_do = jnp.any(do, axis=1)
    if found is None:
        found = find_slots(cache, keys)
    idx = jnp.arange(K, dtype=jnp.int32)
    home = jax.vmap(lambda k: _home(cache, k))(keys)
    big = jnp.iinfo(jnp.int32).max
    # Claims of this batch: a claim array over the table (filled once, then O(K) per round) unless the
    # batch is tiny next to the table; else the batch's own claimed slots, sorted each round (O(K log K)
    # per round, no table-sized array). A sort per round costs more than a fill of 128 slots per row.
    if claims not in ("auto", "table", "sorted"):
        raise ValueError(f"claims must be auto, table or sorted, got {claims!r}")
    by_table = claims == "table" or (claims == "auto" and K * 128 >= size)

    def claims_at(claimed, probe):
        """Owner (batch row) of each probe slot, ``big`` if unclaimed; with table claims, -1 where the
        table holds a hash (one gather answers both)."""
        if by_table:
            return claimed[probe]
        order = jnp.argsort(claimed)
        srt = claimed[order]
        at = jnp.minimum(jnp.searchsorted(srt, probe), K - 1)
        return jnp.where(srt[at] == probe, order[at], big)

    def contest(claimed, free, probe, lane):
        """The earliest free row at each probe slot wins it: (claimed, won)."""
        if by_table:
            claimed = claimed.at[jnp.where(free, probe, size)].min(lane, mode="drop")
            return claimed, free & (claimed[probe] == lane)
        keyed = jnp.where(free, probe, big)
        order = jnp.argsort(keyed, stable=True)                        # equal slots: batch order
        srt = keyed[order]
        first = jnp.concatenate([jnp.ones(1, bool), srt[1:] != srt[:-1]]) & (srt < big)
        won = jnp.zeros(K, bool).at[order].set(first)
        return jnp.where(won, probe, claimed), won

    def body(c, lane, lane_keys):
        """One round for the batch rows ``lane`` (per-lane ``pending``, ``probe``, ``slot_of``, ``opened``:
        the row won its slot's claim; a claimed slot is never contested again, so it stays won)."""
        claimed, pending, probe, slot_of, opened = c
        o = claims_at(claimed, probe)
        taken = o < 0 if by_table else cache.used[probe] > 0
        is_claimed = (o >= 0) & (o < big)
        same = is_claimed & jnp.all(keys[jnp.clip(o, 0, K - 1)] == lane_keys, axis=-1)
        joined = pending & same
        free = pending & ~taken & ~is_claimed
        claimed, won = contest(claimed, free, probe, lane)
        slot_of = jnp.where(won | joined, probe, slot_of)
        moved = pending & (taken | (is_claimed & ~same))
        return claimed, pending & ~(won | joined), jnp.where(moved, (probe + 1) & mask, probe), slot_of, opened | won

    init = jnp.where(cache.used > 0, -1, big) if by_table else jnp.full(K, big, jnp.int32)
    c = (init, row_do & (found < 0), home, jnp.where(row_do, found, -1), jnp.zeros(K, bool))
    # Each round settles most pending rows (on an empty table: 89% of them, then about 70%), so with table
    # claims the rounds run over fewer and fewer lanes: at each level, until the pending rows fit the next
    # level's lanes (an eighth), then over those only. This halves the lane-rounds of a big batch. A small
    # batch (sorted claims) runs all its rounds over every lane.
    lane = idx
    caps = [K]
    while by_table and caps[-1] // 8 >= 64:
        caps.append(caps[-1] // 8)
    slot_of = won = None  # level 0 sets them whole; later levels update their lanes
    for level, cap in enumerate(caps):
        nxt = caps[level + 1] if level + 1 < len(caps) else 0
        lane_keys = keys if level == 0 else keys[jnp.minimum(lane, K - 1)]
        c = jax.lax.while_loop(lambda c: jnp.sum(c[1]) > nxt, lambda c: body(c, lane, lane_keys), c)
        claimed, pending, probe, slot_c, won_c = c
        slot_of = slot_c if level == 0 else slot_of.at[lane].set(slot_c, mode="drop")  # padding lanes drop
        won = won_c if level == 0 else won.at[lane].set(won_c, mode="drop")
        if nxt:
            sel = jnp.nonzero(pending, size=nxt, fill_value=cap)[0]
            sel_c = jnp.minimum(sel, cap - 1)
            lane = jnp.where(sel < cap, lane[sel_c], K).astype(jnp.int32)
            # Pending rows have won nothing yet.
            c = (claimed, pending[sel_c] & (sel < cap), probe[sel_c], slot_c[sel_c], jnp.zeros(nxt, bool))
    at = jnp.where(row_do, slot_of, size)                                # rows write whole table rows
    gids = jnp.arange(G, dtype=jnp.int32)

    flat_b = jnp.where(do, blocks, n).reshape(-1)

    def own_slots(arrays):
        """Every row opened a slot of its own (new hashes, the usual prefill): its entries all open, and
        no two of its blocks share an entry, so they can share one insertion time."""
        block, used, dups, cached_at = arrays
        return (block.at[at].set(jnp.where(do, blocks, 0), mode="drop"),
                used.at[at].set(jnp.sum(do, axis=1, dtype=jnp.int32), mode="drop"), dups,
                cached_at.at[flat_b].set(cache.clock, mode="drop"))

    def shared_slots(arrays):
        """Rows fill entries of slots the table or an earlier row holds: the first block (batch order)
        under an entry empty before the batch opens it, every other block is a duplicate. The rows of
        one slot pick the first with markers written in the table itself: min of (flat index - K * G)
        < 0 over the rows, where the entry is 0 (a free slot's entries all are)."""
        block, used, dups, cached_at = arrays
        before = block[jnp.maximum(slot_of, 0)]                          # [K, G]
        marker = idx[:, None] * G + gids[None, :] - K * G
        cand = do & (before == 0)
        block = block.at[at].min(jnp.where(cand, marker, big), mode="drop")
        opened = cand & (block[jnp.maximum(slot_of, 0)] == marker)
        block = block.at[at].max(jnp.where(opened, blocks, -big), mode="drop")  # each marker's owner opened it
        used = used.at[jnp.where(won, slot_of, size)].set(0, mode="drop")
        used = used.at[at].add(jnp.sum(opened, axis=1, dtype=jnp.int32), mode="drop")
        rank = running_count(do.reshape(-1)) - 1                         # insertion order among the real ones
        return (block, used, dups.at[at].add((do & ~opened).astype(jnp.int32), mode="drop"),  # opened: 0
                cached_at.at[flat_b].set(cache.clock + rank, mode="drop"))

    block, used, dups, cached_at = jax.lax.cond(jnp.all(won == row_do), own_slots, shared_slots,
                                                (cache.block, cache.used, cache.dups, cache.cached_at))
    entry = slot_of[:, None] * G + gids[None, :]
    return replace(
        cache,
        keys=cache.keys.at[jnp.where(won, slot_of, size)].set(keys, mode="drop"),
        used=used,
        block=block,
        dups=dups,
        block_slot=cache.block_slot.at[flat_b].set(entry.reshape(-1), mode="drop"),
        cached_at=cached_at,
        hit=cache.hit.at[flat_b].set(False, mode="drop"),
        clock=cache.clock + jnp.sum(do, dtype=jnp.int32),
    )
