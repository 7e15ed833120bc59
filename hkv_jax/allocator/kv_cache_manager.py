"""``KVCacheManager``: a thin host-side object over the jitted allocator, with vLLM-like methods.

Request ids map to slots of the fixed-shape ``AllocatorState``; each method is
one jitted call. ``state`` is an immutable pytree: keep a reference to it to
snapshot the allocator, assign it back (``restore``) to roll back.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.allocator import host_tier, ops
from hkv_jax.allocator.state import AllocatorState, Layout, init_state
from hkv_jax.planner import KVCacheConfig, merge_parts


@functools.lru_cache(maxsize=None)
def jitted_ops(layout: Layout, donate: bool = False) -> dict[str, Any]:
    """The operations of ``ops`` jitted for ``layout`` (compiled once per layout)."""
    d = (1,) if donate else ()
    return {
        "add": jax.jit(ops.add_request, static_argnums=0, donate_argnums=d),
        "append": jax.jit(ops.append_token, static_argnums=0, donate_argnums=d),
        "accept": jax.jit(ops.accept_drafts, static_argnums=0, donate_argnums=d),
        "schedule": jax.jit(ops.schedule, static_argnums=0, donate_argnums=d),
        "free": jax.jit(ops.free, static_argnums=0, donate_argnums=d),
        "preempt": jax.jit(ops.preempt, static_argnums=0, donate_argnums=d),
        "reset": jax.jit(ops.reset_prefix_cache, static_argnums=0, donate_argnums=d),
        "new_step": jax.jit(ops.new_step, static_argnums=0, donate_argnums=d),
    }


@functools.lru_cache(maxsize=None)
def host_ops(layout: Layout) -> dict[str, Any]:
    """The host tier's table operations (``host_tier``; no pages) jitted for ``layout``."""
    def restore(state, host, slot):
        slots = jnp.full(1, slot, jnp.int32)
        state, host, _ = host_tier.restore(layout, state, host, slots, jnp.ones(1, bool))
        return state, host

    def store_computed(before, state, host):
        return host_tier.store(layout, host_tier.computed_blocks(layout, host, before, state), state, host)[0]

    def store_released(state, host, slot):
        go = jnp.arange(layout.max_requests) == slot
        host = host_tier.store(layout, host_tier.released_blocks(layout, host, state, go), state, host)[0]
        return host_tier.supersede(layout, host, state, go)

    return {"restore": jax.jit(restore), "at_start": jax.jit(host_tier.at_start),
            "store_computed": jax.jit(store_computed), "store_released": jax.jit(store_released)}


@jax.jit
def _request_view(state: AllocatorState, slot) -> dict[str, jax.Array]:
    """One request's scalars and table rows, read in one call (indexing the state from the host would
    dispatch one operation per read)."""
    return {"status": state.status[slot], "num_computed": state.num_computed[slot],
            "num_tokens": state.num_tokens[slot], "tables": state.tables[slot], "table_len": state.table_len[slot]}


class KVCacheManager:
    """Allocator for one ``KVCacheConfig``: ``max_requests`` concurrent requests of up to ``max_model_len`` tokens.

    With ``donate=True`` every call updates the state's buffers in place; a
    state you kept a reference to is then invalid (use ``snapshot()``).
    ``window_aware_eviction=True`` (not vLLM's behaviour) sends blocks that
    leave a sliding window or local chunk to the front of the free queue.
    ``host_blocks > 0``: a host tier's table of that many blocks (``host_tier``; pages are the engine's):
    a waiting request's schedule restores its host hits first, blocks a schedule or accept computes are
    stored after it, and a released request's last window before its release (``host``, a pytree), which
    supersedes its prefix's earlier end windows unless ``host_supersede=False`` (``host_tier.supersede``).
    """

    def __init__(self, cfg: KVCacheConfig, max_model_len: int, max_requests: int = 64, donate: bool = False,
                 window_aware_eviction: bool = False, host_blocks: int = 0, host_unit: int = 0,
                 host_supersede: bool = True):
        self.cfg = cfg
        self.layout = Layout.from_config(cfg, max_model_len, max_requests,
                                         window_aware_eviction=window_aware_eviction)
        self.state: AllocatorState = init_state(self.layout)
        self._ops = jitted_ops(self.layout, donate)
        self._donate = donate
        self._slots: dict[str, int] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self.host = (host_tier.init_host_tier(self.layout, (), host_blocks, max_model_len, unit=host_unit,
                                              supersede=host_supersede)
                     if host_blocks else None)

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot(self) -> tuple[AllocatorState, dict[str, int], list[int]]:
        """The whole allocator (state and request slots), safe to keep across calls."""
        state = jax.tree.map(jnp.copy, self.state) if self._donate else self.state
        return state, dict(self._slots), list(self._free_slots)

    def restore(self, snap: tuple[AllocatorState, dict[str, int], list[int]]) -> None:
        """Roll back to a snapshot."""
        state, slots, free_slots = snap
        self.state = jax.tree.map(jnp.copy, state) if self._donate else state
        self._slots, self._free_slots = dict(slots), list(free_slots)

    # -- requests -------------------------------------------------------------------------------
    def _slot(self, rid: str) -> int:
        try:
            return self._slots[rid]
        except KeyError:
            raise ValueError(f"unknown request {rid!r}") from None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not), null block excluded."""
        return int(self.state.block_pool.free_queue.num_free)

    def add(self, rid: str, prompt: list[int], salt: int = 0) -> None:
        """A new waiting request (no blocks taken)."""
        if rid in self._slots:
            raise ValueError(f"request {rid!r} exists")
        if not prompt or len(prompt) > self.layout.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: need 1..{self.layout.max_model_len}")
        if not self._free_slots:
            raise ValueError(f"all {self.layout.max_requests} request slots are in use")
        slot = self._free_slots.pop()
        toks = np.zeros(self.layout.max_model_len, np.int32)
        toks[: len(prompt)] = prompt
        self.state = self._ops["add"](self.layout, self.state, slot, toks, len(prompt), np.uint32(salt))
        self._slots[rid] = slot

    def schedule(self, rid: str, num_tokens: int | str = "all", output_token: int | None = None,
                 lookahead: int = 0) -> dict[str, Any]:
        """Allocate slots for ``num_tokens`` more tokens (``"all"``: the rest); trace-format result fields.

        When the call completes the known tokens and ``output_token`` is given, it is appended.
        ``lookahead``: slots for that many draft tokens after them too (``accept`` books them).
        """
        slot = self._slot(rid)
        view = jax.device_get(_request_view(self.state, slot))
        was_waiting = int(view["status"]) == 1
        before = int(view["num_computed"])
        want = -1 if num_tokens == "all" else int(num_tokens)
        if want == 0 or want < -1:
            raise ValueError(f"num_tokens must be positive or 'all', got {num_tokens!r}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead!r}")
        if self.host is not None and was_waiting:
            self.state, self.host = host_ops(self.layout)["restore"](self.state, self.host, slot)
        mark = self._host_mark()
        self.state, r = self._ops["schedule"](self.layout, self.state, slot, want, lookahead)
        r = jax.device_get(r)
        res: dict[str, Any] = {"num_computed_tokens_before": before}
        if was_waiting:
            h = int(r.cache_hit_tokens)
            hits = [list(map(int, row[: h // bs])) for row, bs in zip(r.hit_blocks, self.layout.block_sizes)]
            res.update(cache_hit_tokens=h, shared_prefix_boundary=int(r.shared_prefix_boundary),
                       hit_block_ids=merge_parts(self.layout.parts, hits))
        res["num_new_tokens"] = int(r.num_new_tokens)
        if int(r.num_new_tokens) <= 0:
            raise ValueError(f"nothing to schedule for request {rid!r}")
        res["ok"] = bool(r.ok)
        if not r.ok:
            return res
        view = jax.device_get(_request_view(self.state, slot))
        self._host_store(mark)
        tables, lens = view["tables"], view["table_len"]
        parts = self.layout.parts
        res["new_block_ids"] = merge_parts(
            parts, [list(map(int, t[f:n])) for t, f, n in zip(tables, r.first_new, lens)]
        )
        res["num_computed_tokens"] = int(view["num_computed"])
        res["block_table"] = merge_parts(parts, [list(map(int, t[:n])) for t, n in zip(tables, lens)])
        if res["num_computed_tokens"] >= int(view["num_tokens"]) and output_token is not None:
            self.append_token(rid, output_token)
            res["sampled_tokens"] = [int(output_token)]
        return res

    def append_token(self, rid: str, token: int) -> None:
        """Append a sampled token to a request."""
        slot = self._slot(rid)
        if int(jax.device_get(_request_view(self.state, slot))["num_tokens"]) >= self.layout.max_model_len:
            raise ValueError(f"request {rid!r} is at max_model_len ({self.layout.max_model_len})")
        self.state = self._ops["append"](self.layout, self.state, slot, int(token))

    def accept(self, rid: str, tokens: list[int]) -> None:
        """After a schedule of one token with lookahead: append ``tokens`` (the accepted drafts, then the
        target's token) and count the drafts among them as computed (``ops.accept_drafts``)."""
        slot = self._slot(rid)
        view = jax.device_get(_request_view(self.state, slot))
        if not tokens or int(view["num_tokens"]) + len(tokens) > self.layout.max_model_len:
            raise ValueError(f"accept needs 1..{self.layout.max_model_len - int(view['num_tokens'])} tokens, "
                             f"got {len(tokens)}")
        if int(view["num_computed"]) != int(view["num_tokens"]):
            raise ValueError(f"request {rid!r} has known tokens not yet computed: nothing to accept after")
        mark = self._host_mark()
        self.state = self._ops["accept"](self.layout, self.state, np.array([slot], np.int32),
                                         np.array([tokens], np.int32), np.array([len(tokens)], np.int32))
        self._host_store(mark)

    def _host_mark(self):
        """``host_tier.at_start`` with a host tier, else ``None``."""
        return None if self.host is None else host_ops(self.layout)["at_start"](self.state)

    def _host_store(self, mark) -> None:
        """With a host tier: the blocks computed since ``mark`` (``_host_mark``) go down."""
        if mark is not None:
            self.host = host_ops(self.layout)["store_computed"](mark, self.state, self.host)

    def _host_release(self, slot: int) -> None:
        """With a host tier: what the next turn of the request in ``slot`` hits goes down before its release."""
        if self.host is not None:
            self.host = host_ops(self.layout)["store_released"](self.state, self.host, slot)

    def free(self, rid: str) -> None:
        """Release every block of a request and forget it."""
        slot = self._slot(rid)
        self._host_release(slot)
        self.state = self._ops["free"](self.layout, self.state, slot)
        del self._slots[rid]
        self._free_slots.append(slot)

    def preempt(self, rid: str) -> None:
        """Release a running request's blocks; it waits again with its tokens kept."""
        slot = self._slot(rid)
        if int(jax.device_get(_request_view(self.state, slot))["status"]) != 2:
            raise ValueError(f"request {rid!r} is not running")
        self._host_release(slot)
        self.state = self._ops["preempt"](self.layout, self.state, slot)

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry if no block is held."""
        self.state, ok = self._ops["reset"](self.layout, self.state)
        return bool(ok)

    def new_step(self) -> None:
        """A scheduler step begins."""
        self.state = self._ops["new_step"](self.layout, self.state)
