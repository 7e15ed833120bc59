"""The vectorised prefill equals one ``schedule`` per waiting request, in order (the exact path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HYBRID_MODELS, MIXED_MODELS, semantic

from hkv_jax.allocator import ops
from hkv_jax.allocator.hashing import np_block_hashes
from hkv_jax.allocator.prefill import SORTED_HIT_LENGTHS, computes_shared_block
from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.planner import plan

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_prefill_batch")

B, BS, T = 4, 4, 64
add = jax.jit(ops.add_batch, static_argnums=0)
sched = jax.jit(ops.schedule_batch, static_argnums=0)
prefill = jax.jit(ops.prefill_batch, static_argnums=0, static_argnames="fallback")
free = jax.jit(ops.free, static_argnums=0)
new_step = jax.jit(ops.new_step, static_argnums=0)


def admit(layout, st, slots, rng, prefix, vocab):
    """Add ``len(slots)`` waiting requests whose prompts start with ``prefix``."""
    toks = np.zeros((len(slots), T), np.int32)
    lens = rng.integers(len(prefix) + 1, 40, len(slots))
    for i, n in enumerate(lens):
        toks[i, :n] = list(prefix) + list(rng.integers(1, vocab, n - len(prefix)))
    return add(layout, st, jnp.asarray(slots, jnp.int32), jnp.asarray(toks), jnp.asarray(lens, jnp.int32),
               jnp.zeros(len(slots), jnp.uint32))


@pytest.mark.parametrize("model", ["three", "mamba", "full", "mixed-3"])  # "sw+full" is a part of "three"
def test_prefill_batch_equals_sequential_schedules(model):
    cfg = plan({**HYBRID_MODELS, **MIXED_MODELS}[model], block_size=BS, policy="vllm", num_blocks=400)
    layout = Layout.from_config(cfg, max_model_len=T, max_requests=3 * B)
    rng = np.random.default_rng(7)
    runs = []
    # The fallback inside the program (the default) for one model; the smaller program without it
    # (path "not vectorised" applies nothing; the caller runs schedule_batch) for the other.
    fallback = model == "three"

    def check(st, slots, want):
        """Both ways from the same state (one batch shape: one compilation each)."""
        slots, want = jnp.asarray(slots, jnp.int32), jnp.asarray(want, jnp.int32)
        a, ok_a, n_a, h_a, fast = prefill(layout, st, slots, want, fallback=fallback)
        b, ok_b, n_b, h_b = sched(layout, st, slots, want)
        runs.append(bool(fast))
        if not fast and not fallback:  # the program without the fallback applied nothing
            assert not np.asarray(ok_a).any() and semantic(a, layout) == semantic(st, layout)
            return new_step(layout, b)
        assert np.asarray(ok_a).tolist() == np.asarray(ok_b).tolist()
        assert np.asarray(n_a).tolist() == np.asarray(n_b).tolist()
        assert np.asarray(h_a).tolist() == np.asarray(h_b).tolist()
        assert semantic(a, layout) == semantic(b, layout)
        return new_step(layout, b)  # each batch in a scheduler step of its own (Mamba hits need it)

    system = list(rng.integers(1, 1000, 20))  # past 16 tokens: hits on mixed-3's 16-token unit
    # 1. Independent prompts (large vocabulary), whole prompts and chunks: vectorised.
    st = admit(layout, init_state(layout), range(B), rng, [], 1000)
    st = check(st, range(B), [-1, 5, -1, 9])
    # 2. One request brings a 5-block system prompt; 3. four more hit its (held) blocks: vectorised.
    st = admit(layout, st, [B], rng, system, 1000)
    st = admit(layout, st, range(B + 1, 2 * B), rng, [], 1000)
    st = check(st, range(B, 2 * B), [len(system), -1, -1, -1])  # a Mamba state cached after the system prompt
    st = admit(layout, st, range(2 * B, 3 * B), rng, system, 1000)
    st = check(st, range(2 * B, 3 * B), [-1] * B)
    assert runs == [True] * 3 and int(st.num_computed[2 * B]) > 0
    # 4. Hits on freed (queued) blocks, requests sharing blocks with each other: the fallback.
    for s in range(B, 3 * B):
        st = free(layout, st, s)
    st = admit(layout, st, range(B, 2 * B), rng, system, 1000)
    check(st, range(B, 2 * B), [-1] * B)
    assert runs[-1] is False
    # 5. A batch sharing a prefix nobody has cached yet: later requests would hit earlier ones' blocks.
    other = list(rng.integers(1, 1000, 12))
    st = admit(layout, st, range(B, 2 * B), rng, other, 1000)
    check(st, range(B, 2 * B), [-1] * B)
    assert runs[-1] is False


@pytest.mark.parametrize("batch,max_hit", [(8, 3), (12, 11)])  # <= 8 hit lengths: sorted; more: all pairs
def test_shared_computed_blocks_are_found(batch, max_hit):
    """``_computes_shared_block`` equals the definition: two requests agree at the larger hit length."""
    rng = np.random.default_rng(batch)
    check = jax.jit(computes_shared_block)
    seen, lengths = set(), set()
    for _ in range(30):
        toks = rng.integers(1, 3, (batch, 12 * BS))  # two tokens: many shared prefixes
        hashes = np.stack([np_block_hashes(t.tolist(), BS) for t in toks])
        nhit = rng.integers(0, max_hit + 1, batch)
        nfull = np.minimum(nhit + rng.integers(0, 4, batch), 12)
        want = any(max(nhit[i], nhit[j]) < min(nfull[i], nfull[j])
                   and (hashes[i, max(nhit[i], nhit[j])] == hashes[j, max(nhit[i], nhit[j])]).all()
                   for i in range(batch) for j in range(i))
        got = check(jnp.asarray(hashes), jnp.asarray(nhit, jnp.int32), jnp.asarray(nfull, jnp.int32))
        assert bool(got) == want
        seen.add(want)
        lengths.add(len(set(nhit[nhit < nfull])) > SORTED_HIT_LENGTHS)
    assert seen == {True, False} and lengths == ({False} if max_hit < 8 else {True, False})


def test_prefill_recaches_keys_whose_blocks_it_pops():
    """A key the lookup finds past the hit (its block free and cached) is evicted when the pop takes
    that block: the insert must open the key anew, not join the evicted slot. A tiny pool, prompts
    drawn from a few shared ones, everything freed after each batch: partial prefixes stay cached."""
    cfg = plan(HYBRID_MODELS["sw+full"], block_size=BS, policy="vllm", num_blocks=24)
    layout = Layout.from_config(cfg, max_model_len=T, max_requests=2)
    rng = np.random.default_rng(3)
    prompts = rng.integers(1, 1000, (6, 40))
    st, fast_runs = init_state(layout), 0
    slots = jnp.arange(2, dtype=jnp.int32)
    for _ in range(30):
        toks = np.zeros((2, T), np.int32)
        lens = rng.integers(9, 40, 2)
        for i, (n, p) in enumerate(zip(lens, rng.choice(6, 2, replace=False))):
            toks[i, :n] = prompts[p][:n]
        st = add(layout, st, slots, jnp.asarray(toks), jnp.asarray(lens, jnp.int32), jnp.zeros(2, jnp.uint32))
        want = jnp.full(2, -1, jnp.int32)
        a, ok_a, _, _, fast = prefill(layout, st, slots, want, fallback=False)
        b, ok_b, _, _ = sched(layout, st, slots, want)
        if bool(fast):
            fast_runs += 1
            assert np.asarray(ok_a).tolist() == np.asarray(ok_b).tolist()
            assert semantic(a, layout) == semantic(b, layout)
        st = new_step(layout, b)
        for s in range(2):
            st = free(layout, st, s)
    assert fast_runs >= 3  # most batches hit freed blocks: the fallback
