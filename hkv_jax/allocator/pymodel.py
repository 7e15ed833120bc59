"""A plain-Python model of the allocator rules in ``docs/SEMANTICS.md``.

Written from the rules, object by object and without any cleverness, so that
it can serve as the independent oracle for the jitted allocator (property
tests compare the two after every operation) and as a readable statement of
what the numbers in a replay must be.

Block hashes here are exact: a block's hash is the nested tuple
``(parent hash, block tokens, extra keys)``, so two blocks share a hash only if
their whole prefixes are equal. The jitted allocator uses 128-bit hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from hkv_jax.planner import KVCacheConfig, cdiv, merge_parts
from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

NULL = 0
WAITING, RUNNING = "waiting", "running"
ROOT_HASH: Hashable = ("root",)


def block_hashes(tokens: list[int], block_size: int, salt: Hashable = None) -> list[Hashable]:
    """Exact chained hashes of the full blocks of ``tokens`` (the salt keys the first block)."""
    out: list[Hashable] = []
    parent = ROOT_HASH
    for i in range(len(tokens) // block_size):
        extra = salt if i == 0 else None
        parent = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra)
        out.append(parent)
    return out


def skipped_tokens(spec, num_computed: int) -> int:
    """Tokens whose blocks a group no longer needs after ``num_computed`` tokens."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return num_computed - 1
    return 0


@dataclass
class Request:
    """One request's state in the model."""

    tokens: list[int]
    salt: Hashable = None
    num_computed: int = 0
    status: str = WAITING
    tables: list[list[int]] = field(default_factory=list)
    num_cached: list[int | None] = field(default_factory=list)
    # Mamba bookkeeping (vLLM's "align" mode).
    last_state_idx: list[int | None] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)


class PyAllocator:
    """The allocator of one KV cache config, as plain Python objects."""

    def __init__(self, cfg: KVCacheConfig, max_model_len: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        # A Mamba state spanning k pages is k groups of one page (KVCacheConfig.allocator_groups);
        # results list each state's pages together (merge_parts).
        self.groups, self.parts = cfg.allocator_groups()
        # Groups with different block sizes (SEMANTICS.md): one hash every gcd tokens (the hash unit), hits
        # cut to multiples of the lcm (the scheduling unit). One block size: both are that size.
        self.hash_block_size, self.scheduler_block_size = cfg.hash_block_size, cfg.scheduler_block_size
        n = cfg.num_blocks
        self.ref = [0] * n
        self.hash: list[Hashable | None] = [None] * n  # (block hash, group id) the block is cached under
        self.free_queue: list[int] = list(range(1, n))
        self.cache: dict[Hashable, list[int]] = {}  # key -> blocks cached under it, oldest first
        self.requests: dict[str, Request] = {}
        self.cached_this_step: set[Hashable] = set()
        self.puts, self.put_at = 0, [0] * n  # cache insertions so far, and each block's last one
        self.host: PyHostTier | None = None  # set while a lookup also counts host blocks (``PyHostTier.restore``)
        # Groups with equal specs are looked up together; full attention first.
        spec_groups: list[list[int]] = []
        for g in self.groups:
            for sg in spec_groups:
                if self.groups[sg[0]].spec == g.spec and self.groups[sg[0]].block_size == g.block_size:
                    sg.append(g.group_id)
                    break
            else:
                spec_groups.append([g.group_id])
        self.spec_groups = sorted(
            spec_groups, key=lambda sg: not isinstance(self.groups[sg[0]].spec, FullAttentionSpec)
        )

    # ---- block pool -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not); the null block excluded."""
        return len(self.free_queue)

    def _pop_free(self, count: int) -> list[int]:
        taken, self.free_queue = self.free_queue[:count], self.free_queue[count:]
        for b in taken:
            self._evict(b)
            self.ref[b] = 1
        return taken

    def _evict(self, b: int) -> None:
        key = self.hash[b]
        if key is not None:
            self.cache[key].remove(b)
            if not self.cache[key]:
                del self.cache[key]
            self.hash[b] = None

    def _free_blocks(self, ordered: list[int]) -> None:
        first, last = [], []
        for b in ordered:
            if b == NULL:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (first if self.hash[b] is None else last).append(b)
        self.free_queue = first + self.free_queue + last

    def _touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == NULL:
                continue
            if self.ref[b] == 0:
                self.free_queue.remove(b)
            self.ref[b] += 1

    def _cached(self, h: Hashable, gids: list[int]) -> list[int] | None:
        """The (oldest) block cached under ``h`` for each of ``gids``, or None if one has none; while a host
        tier's restore looks up (``self.host``), a key only the host holds counts as its host block, negated."""
        out = []
        for g in gids:
            blocks = self.cache.get((h, g))
            if blocks:
                out.append(blocks[0])
            elif self.host is not None and (h, g) in self.host.block:
                out.append(-self.host.block[h, g])
            else:
                return None
        return out

    def _group_hashes(self, hashes: list[Hashable], g: int) -> list[Hashable]:
        """Group ``g``'s block hashes from the request's hash-unit ones: each block is keyed by the hash at its
        end (block ``i`` of ``k`` hash units: hash ``(i + 1) k - 1``)."""
        k = self.groups[g].block_size // self.hash_block_size
        return hashes[k - 1::k]

    def _aligned(self, blocks: int, bs: int) -> bool:
        """Whether ``blocks`` blocks of ``bs`` tokens end on a multiple of the scheduling unit."""
        return blocks * bs % self.scheduler_block_size == 0

    # ---- per-type hit rules -------------------------------------------------------------------
    def _hit_one(self, gids: list[int], hashes: list[Hashable], max_len: int) -> tuple[list[list[int]], int]:
        g0 = self.groups[gids[0]]
        spec, bs = g0.spec, g0.block_size
        hashes = self._group_hashes(hashes, gids[0])
        nmax = max_len // bs
        per = [[] for _ in gids]
        if isinstance(spec, SlidingWindowSpec):
            need = cdiv(spec.sliding_window - 1, bs)
            per = [[NULL] * nmax for _ in gids]
            run = 0
            for i in range(nmax - 1, -1, -1):
                got = self._cached(hashes[i], gids)
                if got is None or (run == 0 and not self._aligned(i + 1, bs)):  # a run ends on the lcm
                    run = 0
                    continue
                for p, b in zip(per, got):
                    p[i] = b
                run += 1
                if run >= need:
                    return [p[: i + run] for p in per], (i + run) * bs
            while run and not self._aligned(run, bs):  # a short run from block 0: cut to the lcm
                run -= 1
            return [p[:run] for p in per], run * bs
        if isinstance(spec, MambaSpec):
            for i in range(nmax - 1, -1, -1):
                got = self._cached(hashes[i], gids) if self._aligned(i + 1, bs) else None
                if got is not None:
                    return [[NULL] * i + [b] for b in got], (i + 1) * bs
            return per, 0
        start = 0
        if isinstance(spec, ChunkedLocalSpec) and max_len > 0:
            start = max_len // spec.attention_chunk_size * spec.attention_chunk_size // bs
            per = [[NULL] * start for _ in gids]
        for i in range(start, nmax):
            got = self._cached(hashes[i], gids)
            if got is None:
                break
            for p, b in zip(per, got):
                p.append(b)
        n = len(per[0]) * bs // self.scheduler_block_size * self.scheduler_block_size // bs
        return [p[:n] for p in per], n * bs

    def lookup(self, rid: str) -> tuple[list[list[int]], int, int]:
        """Longest prefix hit of a waiting request: (hit blocks per group, hit tokens, shared boundary)."""
        r = self.requests[rid]
        hashes = block_hashes(r.tokens, self.hash_block_size, r.salt)
        hit = len(r.tokens) - 1
        longest = 0
        blocks: list[list[int] | None] = [None] * len(self.groups)
        lengths = [0] * len(self.groups)
        simple = len(self.spec_groups) == 2 and isinstance(self.groups[self.spec_groups[0][0]].spec, FullAttentionSpec)
        while True:
            cur = hit
            for gids in self.spec_groups:
                if isinstance(self.groups[gids[0]].spec, FullAttentionSpec) and blocks[gids[0]] is not None:
                    cur = min(cur, lengths[gids[0]])
                    continue
                per, length = self._hit_one(gids, hashes, cur)
                cur = length
                for g, p in zip(gids, per):
                    blocks[g], lengths[g] = p, length
                longest = max(longest, cur)
            if cur >= hit:
                break
            hit = cur
            if simple:
                break
        for gids in self.spec_groups:
            g0 = self.groups[gids[0]]
            if isinstance(g0.spec, FullAttentionSpec):
                for g in gids:
                    if blocks[g] is not None:
                        blocks[g] = blocks[g][: cdiv(hit, g0.block_size)]
        boundary = longest if longest > hit else 0
        return [b or [] for b in blocks], hit, boundary

    # ---- allocation ---------------------------------------------------------------------------
    def _remove_skipped(self, r: Request, g: int, processed: int) -> None:
        group = self.groups[g]
        bs, table = group.block_size, r.tables[g]
        skip = skipped_tokens(group.spec, processed)
        if isinstance(group.spec, MambaSpec):
            last = min(skip // bs, len(table)) if skip > 0 else 0
            first = r.retired[g]
            if skip > 0 and first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if table[i] != NULL:
                        freed.append(table[i])
                        table[i] = NULL
                self._free_blocks(freed)
                r.retired[g] = last
            idx = r.last_state_idx[g]
            if idx is not None and idx < cdiv(processed, bs) - 1 and table[idx] != NULL:
                self._free_blocks([table[idx]])
                table[idx] = NULL
            return
        if skip <= 0:
            return
        freed = []
        for i in range(min(skip // bs, len(table)) - 1, -1, -1):
            if table[i] == NULL:
                break
            freed.append(table[i])
            table[i] = NULL
        self._free_blocks(freed)

    def _blocks_to_allocate(self, r: Request, g: int, need: int, main: int, hits: list[int], computed: int) -> int:
        group = self.groups[g]
        bs, table = group.block_size, r.tables[g]
        evictable = lambda bl: sum(1 for b in bl if b != NULL and self.ref[b] == 0)  # noqa: E731
        if isinstance(group.spec, MambaSpec):
            if hits and self.hash[hits[-1]] in self.cached_this_step:
                return self.cfg.num_blocks + 1  # a state cached this step cannot serve a hit yet
            new = cdiv(main, bs) - len(hits) - len(table)
            return (min(new, 1) if new > 0 else 0) + evictable(hits)
        required = cdiv(need, bs)
        if r.num_cached[g] is not None:  # running request
            return max(required - len(table), 0)
        skipped = skipped_tokens(group.spec, computed) // bs
        new = max(required - max(skipped, len(hits) + len(table)), 0)
        return new + evictable(hits[max(0, skipped - len(table)) :])

    def _add_hits(self, r: Request, g: int, hits: list[int], computed: int) -> None:
        group = self.groups[g]
        skipped = skipped_tokens(group.spec, computed) // group.block_size
        kept = hits[skipped:]
        self._touch(kept)
        r.tables[g] = [NULL] * skipped + kept
        r.num_cached[g] = len(r.tables[g])

    def _allocate_new(self, r: Request, g: int, need: int, main: int) -> None:
        group = self.groups[g]
        bs, table = group.block_size, r.tables[g]
        if isinstance(group.spec, MambaSpec):
            required = cdiv(main, bs)
            if required <= len(table):
                return
            if table:
                r.last_state_idx[g] = len(table) - 1
            table.extend([NULL] * (required - 1 - len(table)))
            table.extend(self._pop_free(required - len(table)))
            return
        table.extend(self._pop_free(max(cdiv(need, bs) - len(table), 0)))

    def _reachable(self, g: int, i: int) -> bool:
        """Whether block ``i`` of group ``g`` can ever serve a hit, so is cached (dense retention): a sliding
        window that needs fewer blocks than one lcm segment is only looked up from lcm boundaries, so only its
        last blocks before each boundary can serve one."""
        group = self.groups[g]
        if not isinstance(group.spec, SlidingWindowSpec):
            return True
        segment = self.scheduler_block_size // group.block_size
        return i % segment >= segment - max(cdiv(group.spec.sliding_window - 1, group.block_size), 1)

    def _put(self, b: int, key: Hashable) -> None:
        self._evict(b)
        self.hash[b] = key
        self.cache.setdefault(key, []).append(b)
        self.put_at[b], self.puts = self.puts, self.puts + 1

    def _cache(self, r: Request, g: int, num_tokens: int, hashes: list[Hashable]) -> None:
        """Cache group ``g``'s blocks that ``num_tokens`` computed tokens fill, cut to the scheduling unit (a
        block past the last lcm boundary could not serve a hit yet). vLLM's partial entry for a full-attention
        block that holds the prompt's last hash boundary needs no statement here: that boundary is cached only
        once the cut reaches it, and then the whole block is full and gets its full entry in the same call."""
        group = self.groups[g]
        bs = group.block_size
        own = self._group_hashes(hashes, g)
        num_tokens = num_tokens // self.scheduler_block_size * self.scheduler_block_size
        before = r.num_cached[g] or 0
        full = min(num_tokens, len(own) * bs) // bs
        for i in range(before, full):
            b = r.tables[g][i]
            if b == NULL or not self._reachable(g, i):
                continue
            key = (own[i], g)
            self._put(b, key)
            if isinstance(group.spec, MambaSpec):
                self.cached_this_step.add(key)
        r.num_cached[g] = max(before, full)

    def allocate_slots(
        self, rid: str, num_new: int, hits: list[list[int]] | None = None, num_hit: int = 0, lookahead: int = 0
    ) -> list[list[int]] | None:
        """Allocate slots for ``num_new`` more tokens (after ``num_hit`` hit tokens for a waiting request),
        and for ``lookahead`` draft tokens after them (held, never cached: only known tokens are).

        All or nothing across groups: returns the table entries appended after the hit blocks, per
        group, or None when the pool cannot supply the blocks.
        """
        r = self.requests[rid]
        ng = len(self.groups)
        hits = hits or [[] for _ in range(ng)]
        computed = min(r.num_computed + num_hit, self.max_model_len)
        main = computed + num_new
        need = min(main + lookahead, self.max_model_len)
        for g in range(ng):
            self._remove_skipped(r, g, computed)
        wanted = sum(self._blocks_to_allocate(r, g, need, main, hits[g], computed) for g in range(ng))
        if wanted > self.num_free_blocks:
            return None
        if r.status == WAITING:
            for g in range(ng):
                self._add_hits(r, g, hits[g], computed)
        before = [len(t) for t in r.tables]
        for g in range(ng):
            self._allocate_new(r, g, need, main)
        hashes = block_hashes(r.tokens, self.hash_block_size, r.salt)
        for g in range(ng):
            self._cache(r, g, min(computed + num_new, len(r.tokens)), hashes)
        return [t[b:] for t, b in zip(r.tables, before)]

    # ---- requests ---------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], salt: Hashable = None) -> None:
        """A new waiting request."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} exists")
        self.requests[rid] = self._fresh(Request(tokens=list(prompt), salt=salt))

    def _fresh(self, r: Request) -> Request:
        ng = len(self.groups)
        r.tables = [[] for _ in range(ng)]
        r.num_cached = [None] * ng
        r.last_state_idx = [None] * ng
        r.retired = [0] * ng
        r.num_computed = 0
        r.status = WAITING
        return r

    def schedule(self, rid: str, num_tokens: int | str, output_token: int | None, lookahead: int = 0) -> dict[str, Any]:
        """One ``schedule`` event (trace-format 2.3); returns its result fields. ``lookahead``: slots for
        that many draft tokens too (speculative decoding; ``accept`` books the verified ones)."""
        r = self.requests[rid]
        res: dict[str, Any] = {"num_computed_tokens_before": r.num_computed}
        hits, h = None, 0
        if r.status == WAITING:
            hits, h, boundary = self.lookup(rid)
            res.update(cache_hit_tokens=h, shared_prefix_boundary=boundary,
                       hit_block_ids=merge_parts(self.parts, hits))
        remaining = len(r.tokens) - r.num_computed - h
        n = remaining if num_tokens == "all" else min(int(num_tokens), remaining)
        res["num_new_tokens"] = n
        if n <= 0:
            raise ValueError(f"nothing to schedule for request {rid!r}")
        new_ids = self.allocate_slots(rid, n, hits, h, lookahead)
        res["ok"] = new_ids is not None
        if new_ids is None:
            return res
        r.status = RUNNING
        r.num_computed += h + n
        res["new_block_ids"] = merge_parts(self.parts, new_ids)
        res["num_computed_tokens"] = r.num_computed
        res["block_table"] = merge_parts(self.parts, r.tables)
        if r.num_computed >= len(r.tokens) and output_token is not None:
            r.tokens.append(int(output_token))
            res["sampled_tokens"] = [int(output_token)]
        return res

    def accept(self, rid: str, tokens: list[int]) -> None:
        """The verified end of a speculative step: ``tokens`` (accepted drafts, then the target's token) are
        appended, the drafts among them count as computed, and the blocks they fill are cached."""
        r = self.requests[rid]
        r.tokens += [int(t) for t in tokens]
        r.num_computed += len(tokens) - 1
        hashes = block_hashes(r.tokens, self.hash_block_size, r.salt)
        for g in range(len(self.groups)):
            self._cache(r, g, r.num_computed, hashes)

    def free(self, rid: str) -> None:
        """Release every block of a request and forget it."""
        r = self.requests.pop(rid)
        self._release(r)

    def preempt(self, rid: str) -> None:
        """Release every block of a running request; it waits again with its tokens kept."""
        r = self.requests[rid]
        self._release(r)
        self._fresh(r)

    def _release(self, r: Request) -> None:
        for table in r.tables:
            start = 0
            while start < len(table) and table[start] == NULL:
                start += 1
            self._free_blocks(list(reversed(table[start:])))
            table.clear()

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry if no block is held."""
        if self.num_free_blocks != self.cfg.num_blocks - 1:
            return False
        self.cache.clear()
        self.hash = [None] * self.cfg.num_blocks
        return True

    def new_step(self) -> None:
        """A scheduler step begins (Mamba states cached earlier may now serve hits)."""
        self.cached_this_step.clear()


# ---- the host tier (``host_tier.py``), stated plainly -------------------------------------------------


def host_reachable(spec, bs: int, segment: int, i: int) -> bool:
    """Whether block ``i`` of a group of ``spec`` is one a hit ending on a multiple of ``segment`` blocks (the
    host unit) needs: every block of full attention, the window before each multiple for a sliding window,
    the chunk holding each multiple for chunked local attention, the state at each multiple for Mamba."""
    if isinstance(spec, SlidingWindowSpec):
        return i % segment >= segment - max(cdiv(spec.sliding_window - 1, bs), 1)
    if isinstance(spec, ChunkedLocalSpec):
        end = (i // segment + 1) * segment * bs
        return i * bs >= end // spec.attention_chunk_size * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return i % segment == segment - 1
    return True


def needed_blocks(spec, bs: int, unit: int, present: list[bool], end: int) -> list[int]:
    """Indices of the blocks (``present`` says which exist) that the longest hit of one group within ``end``
    tokens, ending on a multiple of ``unit`` tokens (the scheduling unit), uses: the group's hit rule on
    its own."""
    nmax, segment = end // bs, unit // bs

    def run_from(start: int) -> int:  # present blocks from ``start`` on, up to nmax
        i = start
        while i < min(len(present), nmax) and present[i]:
            i += 1
        return i

    if isinstance(spec, SlidingWindowSpec):
        need = max(cdiv(spec.sliding_window - 1, bs), 1)
        for i in range(min(nmax, len(present)) - 1, -1, -1):
            if (i + 1) % segment == 0 and i + 1 >= need and all(present[i + 1 - need:i + 1]):
                return list(range(i + 1 - need, i + 1))
        return list(range(run_from(0) // segment * segment))
    if isinstance(spec, MambaSpec):
        for i in range(min(nmax, len(present)) - 1, -1, -1):
            if (i + 1) % segment == 0 and present[i]:
                return [i]
        return []
    start = 0
    if isinstance(spec, ChunkedLocalSpec) and end > 0:
        start = end // spec.attention_chunk_size * spec.attention_chunk_size // bs
    return list(range(start, run_from(start) // segment * segment))


class PyHostTier:
    """The host tier of a ``PyAllocator``: ``num_blocks`` host blocks (block 0 unused), an LRU list of them
    (head evicted first; every host block is in it), the (block hash, group) each holds, the blocks a
    later release superseded, and the unit. ``max_up`` / ``max_down``: the most blocks one restore / store
    takes (``host_tier.copy_sizes``); a release supersedes at most ``max_up`` (none without ``supersede``)."""

    def __init__(self, alloc: PyAllocator, num_blocks: int, unit: int, max_up: int, max_down: int,
                 supersede: bool = True):
        self.alloc, self.unit, self.max_up, self.max_down = alloc, unit, max_up, max_down
        self.enabled = supersede
        self.lru: list[int] = list(range(1, num_blocks))
        self.key: list[Hashable | None] = [None] * num_blocks
        self.block: dict[Hashable, int] = {}
        self.superseded: set[int] = set()

    def _take(self, count: int) -> list[int]:
        taken, self.lru = self.lru[:count], self.lru[count:]
        self.superseded -= set(taken)
        for hb in taken:
            if self.key[hb] is not None:
                del self.block[self.key[hb]]
                self.key[hb] = None
        return taken

    def restore(self, rid: str) -> None:
        """Before the first schedule of waiting request ``rid``: its longest hit over device and host blocks;
        the blocks only the host holds get new device blocks, cached and freed to the back of the queue with
        the device blocks of the hit, tail first; the host blocks used go to the LRU's back in that order."""
        a, r = self.alloc, self.alloc.requests[rid]
        if r.status != WAITING:
            return
        a.host = self
        try:
            hits, _, _ = a.lookup(rid)
        finally:
            a.host = None
        up = [(g, i) for g, row in enumerate(hits) for i, b in enumerate(row) if b < 0]
        device = [b for row in hits for b in row if b > 0]
        queued = sum(1 for b in device if a.ref[b] == 0)
        if not up or len(up) > a.num_free_blocks - queued or len(up) > self.max_up:
            return
        a._touch(device)
        new = a._pop_free(len(up))
        hashes = block_hashes(r.tokens, a.hash_block_size, r.salt)
        host_used = {}
        for (g, i), b in zip(up, new):
            host_used[g, i] = -hits[g][i]
            hits[g][i] = b
            key = (a._group_hashes(hashes, g)[i], g)
            a._put(b, key)
            a.cached_this_step.discard(key)  # a restored Mamba state is whole: it may serve a hit in this step
        order = [(g, i) for i in range(max(map(len, hits)) - 1, -1, -1) for g in range(len(hits)) if i < len(hits[g])]
        a._free_blocks([hits[g][i] for g, i in order if hits[g][i] != NULL])
        used = [host_used[p] for p in order if p in host_used]
        self.lru = [hb for hb in self.lru if hb not in host_used.values()] + used
        self.superseded -= set(used)

    def mark(self) -> tuple:
        """What ``store_computed`` compares against: each request's ``num_cached``, tokens and computed tokens,
        and the device cache's insertions so far."""
        a = self.alloc
        return ({rid: (list(r.num_cached), len(r.tokens), r.num_computed) for rid, r in a.requests.items()},
                a.puts)

    def store_computed(self, before: tuple) -> None:
        """After a schedule or accept: the blocks it computed that the tier keeps (``host_tier.computed_blocks``)."""
        a = self.alloc
        counts, puts = before
        blocks = []
        for rid, r in a.requests.items():
            if rid not in counts:
                continue
            cached, tokens, computed = counts[rid]
            end = (tokens - 1) // a.scheduler_block_size * a.scheduler_block_size if tokens - computed > 1 else 0
            width = cdiv(a.max_model_len, min(g.block_size for g in a.groups)) + 1
            for g, group in enumerate(a.groups):
                bs = group.block_size
                prompt = set(needed_blocks(group.spec, bs, a.scheduler_block_size, [True] * width, end))
                for i in range(cached[g] or 0, r.num_cached[g] or 0):
                    b = r.tables[g][i]
                    if b != NULL and a.hash[b] is not None and a.put_at[b] >= puts and (
                            host_reachable(group.spec, bs, self.unit // bs, i) or i in prompt):
                        blocks.append(b)
        self.store(blocks[:self.max_down])

    def store_released(self, rid: str) -> None:
        """Before request ``rid`` is freed or preempted: the blocks a hit ending where its cached prefix ends
        needs, in the groups that do not keep every block, as the device cache holds them under its block
        hashes (``host_tier.released_blocks``)."""
        a, r = self.alloc, self.alloc.requests[rid]
        end = min(r.num_computed, len(r.tokens)) // a.scheduler_block_size * a.scheduler_block_size
        hashes = block_hashes(r.tokens, a.hash_block_size, r.salt)
        blocks = []
        for g, group in enumerate(a.groups):
            if isinstance(group.spec, FullAttentionSpec):
                continue
            found = [a.cache[h, g][0] if (h, g) in a.cache else NULL for h in a._group_hashes(hashes, g)]
            for i in needed_blocks(group.spec, group.block_size, a.scheduler_block_size, [b != NULL for b in found],
                                   end):
                blocks.append(found[i])
        self.store(blocks[:self.max_down])
        if self.enabled:
            self._supersede(hashes, end)

    def _supersede(self, hashes: list, end: int) -> None:
        """After ``store_released`` of a request with block hashes ``hashes`` whose cached prefix ends at
        ``end``: the host blocks holding the earlier end windows or states of its prefix (not on a multiple
        of the unit, not its last) go to the LRU's head in block order, behind the blocks that hold nothing,
        superseded (``host_tier.supersede``)."""
        a = self.alloc
        older, last = set(), set()
        for g, group in enumerate(a.groups):
            if isinstance(group.spec, FullAttentionSpec):
                continue
            keys = [(h, g) for h in a._group_hashes(hashes, g)]
            device = [key in a.cache for key in keys]
            held = [self.block.get(key) for key in keys]
            ends = {i for present in (device, [d or h is not None for d, h in zip(device, held)])
                    for i in needed_blocks(group.spec, group.block_size, a.scheduler_block_size, present, end)}
            for i, hb in enumerate(held):
                if hb is None:
                    continue
                if i in ends:
                    last.add(hb)
                elif not host_reachable(group.spec, group.block_size, self.unit // group.block_size, i):
                    older.add(hb)
        moved = sorted(older - last - self.superseded)[:self.max_up]
        if moved:  # behind the blocks that hold nothing (they are used first)
            self.lru = ([hb for hb in self.lru if self.key[hb] is None] + moved
                        + [hb for hb in self.lru if self.key[hb] is not None and hb not in moved])
        self.superseded |= set(moved)

    def store(self, blocks: list[int]) -> None:
        """Device blocks ``blocks`` (cached ones; the first of each key): a key the tier holds moves to the
        LRU's back, the others take the LRU's head in order, as many as there are free host blocks."""
        a = self.alloc
        seen, items = set(), []
        for b in blocks:
            key = a.hash[b]
            if key is None or key in seen:
                continue
            seen.add(key)
            items.append((key, self.block.get(key)))
        held = {hb for _, hb in items if hb is not None}
        self.lru = [hb for hb in self.lru if hb not in held]
        self.superseded -= held
        room = len(self.lru)
        new = [key for key, hb in items if hb is None][:room]
        taken = dict(zip(new, self._take(len(new))))
        back = []
        for key, hb in items:
            if hb is None and key in taken:
                hb = taken[key]
                self.key[hb], self.block[key] = key, hb
            if hb is not None:
                back.append(hb)
        self.lru += back
