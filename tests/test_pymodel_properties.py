"""Stateful property test of the allocator model: random add / schedule / free / preempt / reset sequences
on hybrid models, with the pool invariants of SEMANTICS.md checked after every step.

The same machine will drive the jitted allocator against this model once it exists; here it checks the
model itself (and that a refused allocation changes nothing for a waiting request). Set
HKV_HYPOTHESIS_PROFILE=nightly for a longer run.
"""

import copy
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv_jax.allocator.pymodel import NULL, RUNNING, WAITING, PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

settings.register_profile("ci", max_examples=2000, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=5000, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HKV_HYPOTHESIS_PROFILE", "ci"))

BS = 4
MODELS = {
    "sw+full": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6)],
    "three": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6),
              ChunkedLocalSpec(name="c", num_kv_heads=1, head_size=8, attention_chunk_size=8)],
    "mamba": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              MambaSpec(name="m", shapes=[[2, 4]], dtypes=["float32"])],
}


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = None
        self.next_id = 0

    @precondition(lambda self: self.alloc is None)
    @rule(model=st.sampled_from(sorted(MODELS)), blocks=st.integers(6, 24))
    def setup(self, model, blocks):
        cfg = plan(MODELS[model], block_size=BS, policy="vllm", num_blocks=blocks)
        self.alloc = PyAllocator(cfg, max_model_len=48)

    @precondition(lambda self: self.alloc is not None)
    @rule(prefix=st.integers(0, 3), extra=st.lists(st.integers(1, 3), min_size=1, max_size=20))
    def add(self, prefix, extra):
        # Prompts share one of a few prefixes so that lookups hit.
        prompt = ([5, 6, 7, 8, 9, 10, 11, 12] * 2)[: prefix * 4] + extra
        self.alloc.add(f"r{self.next_id}", prompt[:40])
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
        if not res["ok"] and r.status == WAITING:
            # A refused first schedule takes nothing.
            assert before == (self.alloc.ref, self.alloc.free_queue, self.alloc.cache, self.alloc.hash)
        if res["ok"]:
            assert all(len(t) == -(-r.num_computed // BS) for t in r.tables)

    @precondition(lambda self: self.alloc is not None and self.alloc.requests)
    @rule(data=st.data())
    def free(self, data):
        self.alloc.free(data.draw(st.sampled_from(sorted(self.alloc.requests))))

    @precondition(lambda self: self.alloc is not None and any(r.status == RUNNING for r in self.alloc.requests.values()))
    @rule(data=st.data())
    def preempt(self, data):
        running = sorted(k for k, r in self.alloc.requests.items() if r.status == RUNNING)
        self.alloc.preempt(data.draw(st.sampled_from(running)))

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def reset(self):
        held = any(any(t) for r in self.alloc.requests.values() for t in r.tables)
        assert self.alloc.reset_prefix_cache() == (not held)

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def new_step(self):
        self.alloc.new_step()

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
