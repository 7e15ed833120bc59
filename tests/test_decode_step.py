"""The vectorised decode step equals one ``schedule`` per request, in order (the exact path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HYBRID_MODELS, MIXED_MODELS, semantic

from hkv_jax.allocator import ops
from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.planner import plan

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_decode_step")

B, BS, T = 6, 4, 64
MODELS = {**HYBRID_MODELS, **MIXED_MODELS}


# "sw+full" is a part of "three"; the unaligned ample pool only for "three" (the suite's time budget).
# ``early``: window-aware eviction, where the first decode step's many releases go to the front of the
# queue while blocks are taken (each request's new blocks come from them): still vectorised.
# ``lookahead``: each lane also holds slots for 0-5 draft tokens (speculative decoding), some steps
# taking two blocks of a group.
@pytest.mark.parametrize("model,num_blocks,aligned,early,lookahead", [
    ("three", 40, False, False, False), ("three", 200, False, False, False), ("three", 200, True, False, False),
    ("three", 200, False, True, False), ("mamba", 40, False, False, False), ("mamba", 200, True, False, False),
    ("full", 200, True, False, False), ("mixed-3", 200, False, False, False), ("three", 200, False, False, True),
    ("mixed-3", 200, False, False, True)])
def test_decode_step_equals_sequential_schedules(model, num_blocks, aligned, early, lookahead):
    cfg = plan(MODELS[model], block_size=BS, policy="vllm", num_blocks=num_blocks)
    layout = Layout.from_config(cfg, max_model_len=T, max_requests=B, window_aware_eviction=early)
    rng = np.random.default_rng(num_blocks)
    toks = np.zeros((B, T), np.int32)
    toks[:, :30] = rng.integers(1, 4, size=(B, 30))  # few distinct tokens: shared prefixes and cache hits
    toks[1] = toks[0]
    slots = jnp.arange(B, dtype=jnp.int32)
    st = jax.jit(ops.add_batch, static_argnums=0)(
        layout,
        init_state(layout),
        slots,
        jnp.asarray(toks),
        jnp.asarray(np.full(B, 13) if aligned else rng.integers(5, 30, B), jnp.int32),
        jnp.zeros(B, jnp.uint32),
    )
    sched = jax.jit(ops.schedule_batch, static_argnums=0)
    st, ok, _, _ = sched(layout, st, slots, jnp.full(B, -1, jnp.int32))
    running = np.flatnonzero(np.asarray(ok))
    assert len(running) >= 2
    run = jnp.asarray(running, jnp.int32)
    append = jax.jit(ops.append_batch, static_argnums=0)
    decode = jax.jit(ops.decode_step, static_argnums=0, static_argnames="fallback")
    check_idle = aligned and model in ("three", "full")  # idle_decode's answer against the whole step's path
    # The fallback inside the program (the default) once; elsewhere the smaller program without it,
    # where path 3 applies nothing and the caller runs schedule_batch.
    fallback = model == "three" and num_blocks == 40
    paths = set()
    for _ in range(12):
        st = append(layout, st, run, jnp.asarray(rng.integers(1, 4, len(running)), jnp.int32))
        la = jnp.asarray(rng.integers(0, 6, len(running)) if lookahead else np.zeros(len(running)), jnp.int32)
        a, ok_a, path = decode(layout, st, run, fallback=fallback, lookahead=la)
        paths.add(int(path))
        b, ok_b, _, _ = sched(layout, st, run, jnp.ones(len(running), jnp.int32), None, la)
        want, want_ok = (st, [False] * len(running)) if int(path) == 3 and not fallback else (b, ok_b)
        assert np.asarray(ok_a).tolist() == np.asarray(want_ok).tolist()
        assert semantic(a, layout) == semantic(want, layout)
        if check_idle:
            after, idle = ops.idle_decode(layout, st, run)  # jitted inside
            assert bool(idle) == (int(path) == 0)
            # Idle: exactly the whole step's state; busy: the state unchanged.
            same = jax.tree.map(lambda x, y: np.array_equal(x, y), after, a if bool(idle) else st)
            assert all(jax.tree.leaves(same))
            paths.add(10 + int(idle))
        st = b
        if not np.asarray(ok_b).all():
            break
    # The vectorised paths were checked, not only the fallback: requests in step count tokens only
    # in most steps; a window group's first decode step releases several blocks per call.
    assert 1 in paths and (0 in paths or not aligned)
    assert 2 in paths or model in ("mamba", "full") or num_blocks == 40
    assert 3 in paths or num_blocks != 40  # the small pool reaches the fallback
    assert not check_idle or {10, 11} <= paths
