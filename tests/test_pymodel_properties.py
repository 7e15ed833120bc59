"""Stateful property test: random add / schedule / free / preempt / reset / new-step sequences on hybrid
models drive the jitted allocator (``KVCacheManager``) and the plain-Python model (``PyAllocator``) side by
side. After every step the two must agree (results, free-queue order, ref counts, tables, cached blocks) and
the pool invariants of SEMANTICS.md must hold. Set HKV_HYPOTHESIS_PROFILE=nightly for a longer run.
"""

import copy
import os

import jax
from conftest import HYBRID_MODELS, MIXED_MODELS
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv_jax.allocator.free_queue import queue_order
from hkv_jax.allocator.kv_cache_manager import KVCacheManager
from hkv_jax.allocator.pymodel import NULL, RUNNING, WAITING, PyAllocator
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


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = None
        self.jax = None
        self.next_id = 0
        self.mamba = False
        self.held = {}  # request id -> the most tokens a speculative step held slots for

    @precondition(lambda self: self.alloc is None)
    @rule(model=st.sampled_from(sorted(MODELS)))
    def setup(self, model):
        # One pool size per model, so that the jitted operations compile once per model.
        cfg = plan(MODELS[model], block_size=BS, policy=POLICY.get(model, "vllm"), num_blocks=NUM_BLOCKS.get(model, 10))
        self.mamba = any(isinstance(s, MambaSpec) for s in MODELS[model])  # Mamba layers do not speculate
        self.alloc = PyAllocator(cfg, max_model_len=48)
        self.jax = KVCacheManager(cfg, max_model_len=48, max_requests=MAX_REQUESTS)

    @precondition(lambda self: self.alloc is not None and len(self.alloc.requests) < MAX_REQUESTS)
    @rule(prefix=st.integers(0, 5), extra=st.lists(st.integers(1, 3), min_size=1, max_size=20))
    def add(self, prefix, extra):
        # Prompts share one of a few prefixes so that lookups hit (on 16-token boundaries too).
        prompt = (([5, 6, 7, 8, 9, 10, 11, 12] * 3)[: prefix * 4] + extra)[:40]
        self.alloc.add(f"r{self.next_id}", prompt)
        self.jax.add(f"r{self.next_id}", prompt)
        self.next_id += 1

    @precondition(lambda self: self.alloc is not None and self.alloc.requests)
    @rule(data=st.data(), chunk=st.one_of(st.just("all"), st.integers(1, 12)), token=st.integers(1, 3))
    def schedule(self, data, chunk, token):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests)))
        r = self.alloc.requests[rid]
        if len(r.tokens) >= 47 or (r.status == RUNNING and r.num_computed >= len(r.tokens)):
            return
        before = copy.deepcopy((self.alloc.ref, self.alloc.free_queue, self.alloc.cache, self.alloc.hash))
        res = self.alloc.schedule(rid, chunk, token)
        assert self.jax.schedule(rid, chunk, token) == res
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
        lookahead = min(lookahead, 47 - len(r.tokens))
        res = self.alloc.schedule(rid, 1, None, lookahead)
        assert self.jax.schedule(rid, 1, None, lookahead) == res
        if res["ok"]:
            self.held[rid] = max(self.held.get(rid, 0), min(r.num_computed + lookahead, 48))
            emitted = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=lookahead + 1))
            self.alloc.accept(rid, emitted)
            self.jax.accept(rid, emitted)

    @precondition(lambda self: self.alloc is not None and self.alloc.requests)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.alloc.requests)))
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
