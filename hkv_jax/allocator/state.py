"""``AllocatorState``: everything the allocator knows, as one pytree of fixed-shape arrays.

Shapes are fixed by a ``Layout`` (static): ``R`` request slots, ``G`` allocator
groups (the KV cache groups, a Mamba group whose state spans ``k`` pages
counted ``k`` times), ``M`` table entries per request and group, ``N`` blocks,
``T`` tokens per request (``max_model_len``), ``H = T // hash_block_size`` block hashes.

Groups may have different block sizes (``docs/allocator.md``, "Groups with different block sizes"): one
hash every ``hash_block_size`` tokens (their gcd), a group's block keyed by the hash at its end, hits and
caching cut to multiples of ``scheduler_block_size`` (their lcm). With one block size both units are it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.allocator import block_pool
from hkv_jax.allocator.managers import manager
from hkv_jax.planner import KVCacheConfig, cdiv

# Request slot status.
EMPTY, WAITING, RUNNING = 0, 1, 2

# The per-request counters, packed as columns of one array (``AllocatorState.counts``): a host loop's
# idle-decode check passes one array in and out, not seven (on CPU every array a jitted call takes or
# returns adds to its fixed cost), and a step that updates several counters writes each row once.
REQUEST_COUNTERS = ("status", "num_tokens", "num_computed")            # one column each
GROUP_COUNTERS = ("table_len", "num_cached", "last_state", "retired")  # one column per group each


def _num_counters(G: int) -> int:
    return len(REQUEST_COUNTERS) + len(GROUP_COUNTERS) * G


def _groups_of(counts: jax.Array) -> int:
    """G, from the width of counts rows."""
    return (counts.shape[-1] - len(REQUEST_COUNTERS)) // len(GROUP_COUNTERS)


def _columns(name: str, G: int) -> tuple[int, int]:
    """(first column, width) of counter ``name`` in a counts row of ``G`` groups."""
    if name in REQUEST_COUNTERS:
        return REQUEST_COUNTERS.index(name), 1
    if name in GROUP_COUNTERS:
        return len(REQUEST_COUNTERS) + GROUP_COUNTERS.index(name) * G, G
    raise KeyError(f"unknown counter {name!r}; counters: {REQUEST_COUNTERS + GROUP_COUNTERS}")


def counter(counts: jax.Array, name: str) -> jax.Array:
    """Counter ``name`` of counts rows ``i32[..., 3 + 4G]``: ``i32[...]`` for a request counter,
    ``i32[..., G]`` for a group counter."""
    start, width = _columns(name, _groups_of(counts))
    return counts[..., start] if name in REQUEST_COUNTERS else counts[..., start:start + width]


def set_counters(counts: jax.Array, at, group: int | None = None, **values) -> jax.Array:
    """``counts`` with the named counters of rows ``at`` (a slot, ``i32[B]`` slots or a slice) set,
    as one row scatter. Values broadcast against the rows: a request counter's to ``at``'s shape, a
    group counter's to ``at``'s shape + ``[G]``, or to ``at``'s shape alone with ``group`` (set only that
    group's column; a Python int or a traced index, as in ``for_each_group``)."""
    G = _groups_of(counts)
    rows = counts[at]
    for name, value in values.items():
        start, width = _columns(name, G)
        value = jnp.asarray(value, jnp.int32)
        if name in REQUEST_COUNTERS or group is not None:  # one column (``group`` may be traced)
            col = start + (0 if name in REQUEST_COUNTERS else group)
            rows = rows.at[..., col].set(jnp.broadcast_to(value, rows.shape[:-1]))
            continue
        if value.ndim not in (0, rows.ndim):
            # An i32[B] value would broadcast along the groups axis (silently, when B == G).
            raise ValueError(f"{name}: give one value per group (shape [..., G] or [..., 1]), got {value.shape}")
        cols = rows[..., start:start + width]
        rows = rows.at[..., start:start + width].set(jnp.broadcast_to(value, cols.shape))
    return counts.at[at].set(rows)


def hash_once(self) -> int:
    """``__hash__`` for frozen dataclasses passed to ``jax.jit`` as static arguments: jit hashes them on
    every call, and a layout or a model graph hashes field by field (hundreds of microseconds a step);
    this computes it once per object."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in fields(self)))
        object.__setattr__(self, "_hash", h)
    return h


def _rules(group) -> tuple:
    """What decides a group's allocation and hit rules: its spec and block size (``Layout.spec_groups``,
    ``Layout.group_runs``)."""
    return group.spec, group.block_size


@dataclass(frozen=True)
class Layout:
    """Static shapes and per-group rules of one allocator (hashable: usable as a jit static argument)."""

    __hash__ = hash_once

    groups: tuple  # tuple[KVCacheGroup, ...]: the allocator groups (KVCacheConfig.allocator_groups)
    parts: tuple[tuple[int, ...], ...]  # the allocator groups of each KV cache group
    num_blocks: int
    block_sizes: tuple[int, ...]  # tokens per block of each allocator group
    hash_block_size: int  # tokens per block hash: the gcd of the block sizes
    scheduler_block_size: int  # hits and caching are cut to multiples of this: the lcm of the block sizes
    max_model_len: int
    max_requests: int
    max_blocks: int  # table entries per request and group
    spec_groups: tuple[tuple[int, ...], ...]  # groups looked up together (same spec and block size); full first
    simple_hybrid: bool  # exactly two spec groups, the first full attention: one coordinator pass
    # Our policy, off in vLLM mode: blocks a sliding-window / chunked-local group releases as they
    # leave the window go to the front of the free queue (evicted first), not the back.
    window_aware_eviction: bool = False

    @staticmethod
    def from_config(cfg: KVCacheConfig, max_model_len: int, max_requests: int,
                    window_aware_eviction: bool = False) -> "Layout":
        """The layout of ``cfg``; raises ``ValueError`` for a ``max_requests`` or ``max_model_len`` below 1."""
        if max_requests < 1 or max_model_len < 1:
            raise ValueError("max_requests and max_model_len must be positive")
        groups, parts = cfg.allocator_groups()
        spec_groups: list[list[int]] = []
        for g in groups:
            for sg in spec_groups:
                if _rules(groups[sg[0]]) == _rules(g):
                    sg.append(g.group_id)
                    break
            else:
                spec_groups.append([g.group_id])
        spec_groups.sort(key=lambda sg: not groups[sg[0]].spec.keeps_every_token)
        sizes = tuple(g.block_size for g in groups)
        return Layout(
            groups=groups,
            parts=parts,
            num_blocks=cfg.num_blocks,
            block_sizes=sizes,
            hash_block_size=cfg.hash_block_size,
            scheduler_block_size=cfg.scheduler_block_size,
            max_model_len=max_model_len,
            max_requests=max_requests,
            max_blocks=cdiv(max_model_len, min(sizes)) + 1,
            spec_groups=tuple(tuple(sg) for sg in spec_groups),
            simple_hybrid=len(spec_groups) == 2 and groups[spec_groups[0][0]].spec.keeps_every_token,
            window_aware_eviction=window_aware_eviction,
        )

    @property
    def num_groups(self) -> int:
        """G: allocator groups (a Mamba group whose state spans k pages counts k times)."""
        return len(self.groups)

    @property
    def one_block_size(self) -> bool:
        """Whether every group has the same block size (then block and hash indices coincide)."""
        return len(set(self.block_sizes)) == 1

    @property
    def num_hashes(self) -> int:
        """H: block hashes per request."""
        return self.max_model_len // self.hash_block_size

    def hashes_per_block(self, g: int) -> int:
        """k: hash units in one block of group ``g``."""
        return self.block_sizes[g] // self.hash_block_size

    def key_index(self, g: int, n: int) -> np.ndarray:
        """``i32[n]``: the hash index that keys each of group ``g``'s first ``n`` blocks (the hash at the
        block's end, ``(i + 1) k - 1``), clipped to the hashes there are; ``key_valid`` says which exist."""
        return np.minimum((np.arange(n) + 1) * self.hashes_per_block(g) - 1, self.num_hashes - 1).astype(np.int32)

    def key_valid(self, g: int, n: int) -> np.ndarray:
        """``bool[n]``: which of group ``g``'s first ``n`` blocks have a hash (``key_index``)."""
        return (np.arange(n) + 1) * self.hashes_per_block(g) <= self.num_hashes

    def reachable(self, g: int, n: int) -> np.ndarray:
        """``bool[n]``: which of group ``g``'s first ``n`` blocks can ever serve a hit, so are cached (dense
        retention): the group's manager says (``managers.py``; a sliding window's last blocks before each
        multiple of the scheduling unit, every block elsewhere)."""
        spec, bs = self.groups[g].spec, self.block_sizes[g]
        return manager(spec).reachable(spec, bs, self.scheduler_block_size // bs, n)

    def host_reachable(self, g: int, n: int, unit: int) -> np.ndarray:
        """``bool[n]``: which of group ``g``'s first ``n`` blocks a hit ending on a multiple of ``unit`` tokens
        (the host tier's unit, a multiple of the scheduling unit) needs (its manager says)."""
        spec, bs = self.groups[g].spec, self.block_sizes[g]
        return manager(spec).host_reachable(spec, bs, unit // bs, n)

    def config_tables(self, tables):
        """Per-KV-cache-group tables ``[..., M * k]`` from ``tables: [..., G, M]`` (numpy or jax).

        A spanning Mamba group's table lists each entry's ``k`` pages in part
        order (``merge_parts``); other groups' tables are their rows as they are.
        """
        out = []
        for p in self.parts:
            t = tables[..., list(p), :]                         # [..., k, M]
            out.append(t.swapaxes(-1, -2).reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1]))  # also 0 rows
        return out

    @property
    def group_runs(self) -> tuple[tuple[int, int], ...]:
        """Runs ``[a, b)`` of consecutive groups with the same spec and block size, hence the same rules
        (``for_each_group``)."""
        runs = []
        for g, group in enumerate(self.groups):
            if runs and _rules(self.groups[runs[-1][0]]) == _rules(group):
                runs[-1][1] = g + 1
            else:
                runs.append([g, g + 1])
        return tuple(map(tuple, runs))

    def is_mamba(self, g: int) -> bool:
        """Whether group ``g`` holds Mamba states."""
        return self.groups[g].spec.recurrent

    @property
    def mamba_groups(self) -> tuple[int, ...]:
        """The groups that hold Mamba states, in order."""
        return tuple(g for g in range(self.num_groups) if self.is_mamba(g))

    def step_cached_index(self, cache, blocks: jax.Array) -> jax.Array:
        """Index into ``AllocatorState.step_cached`` of the prefix-cache entry (slot, Mamba group) each
        of ``blocks`` is cached under; ``step_cached``'s size where it is not cached in a Mamba group."""
        G, mamba = self.num_groups, self.mamba_groups
        if not mamba:
            return jnp.full(blocks.shape, 1, jnp.int32)  # past the one unused entry
        size = cache.used.shape[0] * len(mamba)
        nth = jnp.array([mamba.index(g) if g in mamba else -1 for g in range(G)], jnp.int32)
        e = cache.block_slot[jnp.maximum(blocks, 0)]
        m = nth[jnp.maximum(e, 0) % G]
        return jnp.where((blocks > 0) & (e >= 0) & (m >= 0), e // G * len(mamba) + m, size)

    def evicts_early(self, g: int) -> bool:
        """Whether blocks leaving group ``g``'s window go to the queue front (window-aware eviction)."""
        return self.window_aware_eviction and manager(self.groups[g].spec).windowed


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AllocatorState:
    """The allocator's state.

    Fields:
      block_pool: the block pool (free queue + prefix cache).
      step_cached: ``bool[num_slots * num_mamba_groups]`` prefix-cache entries (slot, Mamba group) a Mamba
        group cached during the current step (``Layout.step_cached_index``); ``bool[1]``, unused, without
        Mamba groups.
      counts: ``i32[R, 3 + 4G]`` the per-request counters, one row per slot (read them by name:
        the properties below; write them with ``with_counters``).
      tokens: ``i32[R, T]`` known tokens of each request.
      salt: ``u32[R, 1]`` cache salt (keys the first block's hash).
      hashes: ``u32[R, H, 4]`` chained hashes of the known tokens, one per ``hash_block_size`` tokens.
      tables: ``i32[R, G, M]`` block tables (0 = null block).

    Counters (views of ``counts``):
      status: ``i32[R]`` EMPTY / WAITING / RUNNING per request slot.
      num_tokens: ``i32[R]`` known tokens; ``num_computed``: ``i32[R]`` tokens with KV in the cache.
      table_len: ``i32[R, G]`` entries in each table.
      num_cached: ``i32[R, G]`` leading table entries already entered in the prefix cache.
      last_state: ``i32[R, G]`` Mamba: table index of the previous state block, -1 if none.
      retired: ``i32[R, G]`` Mamba: table entries below this index were released.
    """

    block_pool: block_pool.BlockPool
    step_cached: jax.Array
    counts: jax.Array
    tokens: jax.Array
    salt: jax.Array
    hashes: jax.Array
    tables: jax.Array

    status = property(lambda self: counter(self.counts, "status"))
    num_tokens = property(lambda self: counter(self.counts, "num_tokens"))
    num_computed = property(lambda self: counter(self.counts, "num_computed"))
    table_len = property(lambda self: counter(self.counts, "table_len"))
    num_cached = property(lambda self: counter(self.counts, "num_cached"))
    last_state = property(lambda self: counter(self.counts, "last_state"))
    retired = property(lambda self: counter(self.counts, "retired"))

    def with_counters(self, at, group: int | None = None, **values) -> "AllocatorState":
        """This state with the named counters of slot(s) ``at`` set (``set_counters``)."""
        return replace(self, counts=set_counters(self.counts, at, group, **values))


def for_each_group(layout: Layout, body, carry):
    """``carry = body(rule, g, carry)`` for every group ``g`` in order, where ``rule`` is the first group of
    ``g``'s run (``Layout.group_runs``): ``body`` reads the group's static rules (spec, block size, window)
    through ``rule`` and indexes arrays with ``g``. A run of several groups is one ``fori_loop`` with ``g``
    traced, so a program holds one copy of ``body`` per run, not one per group (Gemma 3's five sliding
    groups: one copy); a run of one passes ``g`` as a Python int."""
    for a, b in layout.group_runs:
        if b - a == 1:
            carry = body(a, a, carry)
        else:
            carry = jax.lax.fori_loop(a, b, functools.partial(body, a), carry)
    return carry


@functools.partial(jax.jit, static_argnums=0)  # one dispatch instead of one per array (~70x faster on CPU)
def init_state(layout: Layout) -> AllocatorState:
    """An empty allocator: every block free, no request, nothing cached (a jitted call; ``layout`` static)."""
    R, G, M, T = layout.max_requests, layout.num_groups, layout.max_blocks, layout.max_model_len
    bp = block_pool.init_block_pool(layout.num_blocks, G)
    return AllocatorState(
        block_pool=bp,
        # One unused entry without Mamba groups (checkpointing refuses zero-size arrays).
        step_cached=jnp.zeros(max(bp.prefix_cache.used.shape[0] * len(layout.mamba_groups), 1), bool),
        counts=set_counters(jnp.zeros((R, _num_counters(G)), jnp.int32), slice(None), last_state=-1),
        tokens=jnp.zeros((R, T), jnp.int32),
        salt=jnp.zeros((R, 1), jnp.uint32),
        hashes=jnp.zeros((R, layout.num_hashes, 4), jnp.uint32),
        tables=jnp.zeros((R, G, M), jnp.int32),
    )


# Fields a schedule never changes: kept out of ``lax.cond`` outputs, so XLA need not copy them.
_READ_ONLY = ("tokens", "salt", "hashes")


def switch_mutable(index, fns, state: AllocatorState):
    """``lax.switch(index, fns, state)`` for functions returning ``(state, aux)`` that leave the fields a
    schedule never changes (tokens, salt, hashes) as they are: only the other fields pass through the
    conditional, so XLA need not copy the big read-only arrays in every branch."""
    def wrap(fn):
        def run(mutable):
            st, aux = fn(replace(state, **mutable))
            return {f: getattr(st, f) for f in mutable}, aux
        return run

    mutable = {f: getattr(state, f) for f in state.__dataclass_fields__ if f not in _READ_ONLY}
    out, aux = jax.lax.switch(index, [wrap(f) for f in fns], mutable)
    return replace(state, **out), aux


def cond_mutable(pred, true_fn, false_fn, state: AllocatorState):
    """``lax.cond`` form of ``switch_mutable``."""
    return switch_mutable(jnp.where(pred, 0, 1), [true_fn, false_fn], state)
