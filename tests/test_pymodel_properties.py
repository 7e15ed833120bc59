"""Stateful property test: random add / schedule / free / preempt / reset / new-step sequences on hybrid
models drive the jitted allocator (``KVCacheManager``) and the plain-Python model (``PyAllocator``) side by
side. After every step the two must agree (results, free-queue order, ref counts, tables, cached blocks) and
the pool invariants of SEMANTICS.md must hold. Runs on three of the models may add a small host tier on both
sides (``host_tier`` and ``PyHostTier``): restores before first schedules, stores after schedules and before
releases; its LRU order, the key each host block holds and the blocks a release superseded must agree
too. Set HKV_HYPOTHESIS_PROFILE=nightly for a longer run.
"""

import copy
import os

import jax
import numpy as np
from conftest import HYBRID_MODELS, MIXED_MODELS
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv_jax.allocator.free_queue import queue_order
from hkv_jax.allocator.host_tier import copy_sizes
from hkv_jax.allocator.kv_cache_manager import KVCacheManager
from hkv_jax.allocator.pymodel import NULL, RUNNING, WAITING, PyAllocator, PyHostTier
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec, MambaSpec

settings.register_profile("ci", max_examples=200, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=5000, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HKV_HYPOTHESIS_PROFILE", "ci"))

BS = 4
MAX_REQUESTS = 6
# A Mamba state of 384 bytes spans three 128-byte pages under the min-waste planner.
MODELS = {**HYBRID_MODELS, "mamba-span": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                                          MambaSpec(name="m", shapes=[[2, 48]], dtypes=["float32"])]}
POLICY = {"mamba-span": "min-waste"}
MODELS.update(MIXED_MODELS)  # groups of different block sizes
NUM_BLOCKS = {"mixed-2": 14, "mixed-3": 20}
HOST_BLOCKS = 9  # a host tier this small evicts: its LRU order matters
# Every model runs without a host tier; these three also with one: between them every kind of group (a Mamba
# state over several pages), and groups of three block sizes. Each (model, tier) compiles its own operations.
HOST_MODELS = ("mamba-span", "mixed-3", "three")
SETUPS = [(model, False) for model in sorted(MODELS)] + [(model, True) for model in HOST_MODELS]


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = None
        self.jax = None
        self.next_id = 0
        self.mamba = False
        self.held = {}  # request id -> the most tokens a speculative step held slots for
        self.host = None  # the model's host tier (PyHostTier), with one
        self.keys = {}  # the model's block hash -> the jitted allocator's, of every block both cached
        self.seen = []  # prompts added and requests' tokens at their release: what ``again`` adds again

    @precondition(lambda self: self.alloc is None)
    @rule(case=st.sampled_from(SETUPS))
    def setup(self, case):
        model, host = case
        # One pool size per model, so that the jitted operations compile once per model.
        cfg = plan(MODELS[model], block_size=BS, policy=POLICY.get(model, "vllm"), num_blocks=NUM_BLOCKS.get(model, 10))
        self.mamba = any(isinstance(s, MambaSpec) for s in MODELS[model])  # Mamba layers do not speculate
        self.alloc = PyAllocator(cfg, max_model_len=48)
        # A host unit of three scheduling units: hits on the host end on its multiples or at a prompt's or
        # request's end; a 6-token window (two blocks) leaves a block in three to an end alone.
        unit = 3 * cfg.scheduler_block_size
        self.jax = KVCacheManager(cfg, max_model_len=48, max_requests=MAX_REQUESTS,
                                  host_blocks=HOST_BLOCKS if host else 0, host_unit=unit)
        if host:
            self.host = PyHostTier(self.alloc, HOST_BLOCKS, unit, *copy_sizes(self.jax.layout, 48))

    @precondition(lambda self: self.alloc is not None and len(self.alloc.requests) < MAX_REQUESTS)
    @rule(prefix=st.integers(0, 5), extra=st.lists(st.integers(1, 3), min_size=1, max_size=20))
    def add(self, prefix, extra):
        # Prompts share one of a few prefixes so that lookups hit (on 16-token boundaries too).
        prompt = (([5, 6, 7, 8, 9, 10, 11, 12] * 3)[: prefix * 4] + extra)[:40]
        self._add(prompt)

    def _add(self, prompt):
        self.alloc.add(f"r{self.next_id}", prompt)
        self.jax.add(f"r{self.next_id}", prompt)
        self.next_id += 1
        self.seen.append(list(prompt))

    @precondition(lambda self: self.host is not None and self.seen and len(self.alloc.requests) < MAX_REQUESTS)
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), max_size=6))
    def again(self, data, extra):
        """A prompt seen before, or a released conversation continued: hits the host tier may serve."""
        self._add((data.draw(st.sampled_from(self.seen)) + extra)[:40])

    @precondition(lambda self: self.alloc is not None and self.alloc.requests)
    @rule(data=st.data(), chunk=st.one_of(st.just("all"), st.integers(1, 12)), token=st.integers(1, 3))
    def schedule(self, data, chunk, token):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests)))
        r = self.alloc.requests[rid]
        if len(r.tokens) >= 47 or (r.status == RUNNING and r.num_computed >= len(r.tokens)):
            return
        if self.host is not None:
            self.host.restore(rid)
        mark = self.host and self.host.mark()
        before = copy.deepcopy((self.alloc.ref, self.alloc.free_queue, self.alloc.cache, self.alloc.hash))
        res = self.alloc.schedule(rid, chunk, token)
        assert self.jax.schedule(rid, chunk, token) == res
        if self.host is not None and res["ok"]:
            self.host.store_computed(mark)
        if not res["ok"] and r.status == WAITING:
            # A refused first schedule takes nothing.
            assert before == (self.alloc.ref, self.alloc.free_queue, self.alloc.cache, self.alloc.hash)
        if res["ok"]:  # a table covers the computed tokens, and the lookahead of an earlier speculative step
            held = max(r.num_computed, self.held.get(rid, 0))
            lens = [-(-held // g.block_size) for g in self.alloc.groups]
            assert all(len(t) == n for t, n in zip(r.tables, lens))

    @precondition(lambda self: self.alloc is not None and not self.mamba and any(
        r.status == RUNNING and len(r.tokens) - r.num_computed == 1 for r in self.alloc.requests.values()))
    @rule(data=st.data(), lookahead=st.integers(0, 9))
    def speculate(self, data, lookahead):
        """A speculative decode step: one token scheduled with draft slots, then the verified tokens
        (some accepted drafts and the target's token) booked."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.alloc.requests.items()
                                               if r.status == RUNNING and len(r.tokens) - r.num_computed == 1)))
        r = self.alloc.requests[rid]
        if len(r.tokens) >= 47:  # no room for a token after the one scheduled (as in ``schedule``)
            return
        lookahead = min(lookahead, 47 - len(r.tokens))
        mark = self.host and self.host.mark()
        res = self.alloc.schedule(rid, 1, None, lookahead)
        assert self.jax.schedule(rid, 1, None, lookahead) == res
        if res["ok"]:
            if self.host is not None:
                self.host.store_computed(mark)
            self.held[rid] = max(self.held.get(rid, 0), min(r.num_computed + lookahead, 48))
            emitted = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=lookahead + 1))
            mark = self.host and self.host.mark()
            self.alloc.accept(rid, emitted)
            self.jax.accept(rid, emitted)
            if self.host is not None:
                self.host.store_computed(mark)

    @precondition(lambda self: self.alloc is not None and self.alloc.requests)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests)))
        if self.host is not None:
            self.host.store_released(rid)
            self.seen.append(list(self.alloc.requests[rid].tokens))
        self.alloc.free(rid)
        self.jax.free(rid)
        self.held.pop(rid, None)

    @precondition(
        lambda self: self.alloc is not None and any(r.status == RUNNING for r in self.alloc.requests.values())
    )
    @rule(data=st.data())
    def preempt(self, data):
        running = sorted(k for k, r in self.alloc.requests.items() if r.status == RUNNING)
        rid = data.draw(st.sampled_from(running))
        if self.host is not None:
            self.host.store_released(rid)
        self.alloc.preempt(rid)
        self.jax.preempt(rid)
        self.held.pop(rid, None)

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def reset(self):
        held = any(any(t) for r in self.alloc.requests.values() for t in r.tables)
        assert self.alloc.reset_prefix_cache() == (not held)
        assert self.jax.reset_prefix_cache() == (not held)

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def new_step(self):
        self.alloc.new_step()
        self.jax.new_step()

    @invariant()
    def jitted_allocator_agrees_with_the_model(self):
        if self.alloc is None:
            return
        a, st = self.alloc, self.jax.state
        assert self.jax.num_free_blocks == a.num_free_blocks
        # Host copies of the fields checked (indexing numpy arrays dispatches no jax operation).
        pool, block_slot, tables, lens, computed, ntok = jax.device_get(
            (
                st.block_pool.free_queue,
                st.block_pool.prefix_cache.block_slot,
                st.tables,
                st.table_len,
                st.num_computed,
                st.num_tokens,
            )
        )
        assert queue_order(pool) == a.free_queue
        assert pool.ref_count.tolist() == a.ref
        assert (block_slot >= 0).tolist() == [h is not None for h in a.hash]
        for rid, r in a.requests.items():
            slot = self.jax._slots[rid]
            assert [tables[slot, g, :n].tolist() for g, n in enumerate(lens[slot])] == r.tables
            assert computed[slot] == r.num_computed and ntok[slot] == len(r.tokens)
        if self.host is None:
            return
        # The host tier: its LRU order, and the (hash, group) each host block holds (hashes by the device
        # blocks both sides cached under them: the model's hashes are exact, the jitted ones 128-bit).
        G = len(a.groups)
        keys = jax.device_get(st.block_pool.prefix_cache.keys)
        for b, key in enumerate(a.hash):
            if key is not None:
                self.keys[key[0]] = tuple(keys[block_slot[b] // G].tolist())
        host_pool, host_slot, host_keys, superseded = jax.device_get((self.jax.host.pool.free_queue,
                                                                      self.jax.host.pool.prefix_cache.block_slot,
                                                                      self.jax.host.pool.prefix_cache.keys,
                                                                      self.jax.host.superseded))
        assert queue_order(host_pool) == self.host.lru
        assert set(np.flatnonzero(superseded).tolist()) == self.host.superseded
        for hb, key in enumerate(self.host.key):
            assert (host_slot[hb] >= 0) == (key is not None), hb
            if key is not None:
                assert host_slot[hb] % G == key[1]
                assert tuple(host_keys[host_slot[hb] // G].tolist()) == self.keys[key[0]]

    @invariant()
    def pool_is_consistent(self):
        a = self.alloc
        if a is None:
            return
        n = a.cfg.num_blocks
        holders = [0] * n
        for r in a.requests.values():
            for t in r.tables:
                for b in t:
                    holders[b] += b != NULL
        assert holders[1:] == a.ref[1:], "ref counts equal the number of table entries holding each block"
        free = set(a.free_queue)
        assert len(free) == len(a.free_queue) and NULL not in free, "null block never free"
        assert all(a.ref[b] == 0 for b in free) and all(a.ref[b] > 0 for b in range(1, n) if b not in free)
        assert len(a.free_queue) + sum(1 for b in range(1, n) if a.ref[b] > 0) == n - 1
        assert a.ref[NULL] == 0 and a.hash[NULL] is None, "null block untouched"
        for key, blocks in a.cache.items():
            assert blocks and all(a.hash[b] == key for b in blocks), "cache entries point at blocks with that hash"
        assert sum(len(v) for v in a.cache.values()) == sum(h is not None for h in a.hash)


TestAllocatorModel = AllocatorMachine.TestCase
