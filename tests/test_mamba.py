"""The tiny Mamba-2 mixer: its three computations of the same recurrence agree, a speculative step's state
rewinds to the accepted token; bad configs are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv_jax.attention import make_metadata
from hkv_jax.cache import init_cache, read_mamba_state
from hkv_jax.engine import Engine
from hkv_jax.models.mamba2 import Mamba2, Mamba2Config
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import plan
from hkv_jax.recurrent import commit_accepted
from hkv_jax.spec import MambaSpec


@pytest.mark.parametrize("groups", [1, 2])
def test_quadratic_form_recurrence_and_closed_form_state_agree(groups):
    cfg = Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, d_state=4, n_groups=groups, d_conv=3)
    mixer = Mamba2(cfg, "m", nnx.Rngs(groups))
    x = jax.random.normal(jax.random.PRNGKey(0), (23, 16))
    z, xbc, dt_raw = mixer._split_in(x)
    state = (jnp.zeros((cfg.d_conv - 1, cfg.conv_dim)), jnp.zeros((4, 8, 4)))
    ys, states = [], {}
    for t in range(x.shape[0]):
        state, y = mixer._cell(state, (xbc[t], dt_raw[t]))
        ys.append(y)
        states[t + 1] = state
    np.testing.assert_allclose(mixer._out(jnp.stack(ys), z), mixer.dense(x), atol=1e-5, rtol=1e-5)
    for n in (1, 2, 3, 10, 23):
        for got, want in zip(mixer.dense_state(x, n), states[n]):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # The state after n tokens ignores what follows them.
    for got, want in zip(mixer.dense_state(x[:10]), states[10]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_mamba_1_configs_and_bad_group_counts_are_refused():
    config = dict(resolve_model("tiny-jamba")[1])
    for key in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"):
        config.pop(key)
    with pytest.raises(ValueError, match="Mamba-2"):
        TinyConfig.from_hf(config)
    with pytest.raises(ValueError, match="multiple of mamba_n_groups"):
        Mamba2(Mamba2Config(hidden_size=8, num_heads=3, head_dim=4, d_state=2, n_groups=2), "m", nnx.Rngs(0))


def test_fork_is_refused_for_mamba_models():
    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-jamba")[1]), nnx.Rngs(0))
    eng = Engine(model, num_blocks=16, block_size=16, max_requests=2, max_model_len=64, token_budget=16,
                 impl="reference")
    rid = eng.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="Mamba"):
        eng.fork(rid)


def test_a_speculative_step_records_every_positions_state_and_commits_the_accepted_one():
    """``record_positions``: the mixer records each sequence's state after each of its first P tokens, and
    ``commit_accepted`` writes back the state after the tokens verification kept, in the entry the step
    wrote (a rewind), leaving a sequence that kept all its tokens as the step left it."""
    cfg = Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, d_state=4, n_groups=1, d_conv=3)
    mixer = Mamba2(cfg, "m", nnx.Rngs(0))
    spec = MambaSpec(name="m", shapes=[[cfg.d_conv - 1, cfg.conv_dim], [4, 8, 4]], dtypes=["float32"] * 2)
    cache = init_cache(plan([spec], block_size=8, policy="vllm", num_blocks=4))
    xs = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 16))
    tables = [jnp.array([[1], [2], [3]])]
    # Sequence 0 computed 5 tokens earlier (its state in block 1).
    meta = make_metadata(cache, tables, jnp.array([0, 5, 5, 5]), jnp.array([5, 0, 0]), num_tokens=5)
    _, cache = mixer.paged(xs[0, :5], cache, meta)
    # The step: sequence 0 computes tokens 5..7 and keeps 2, sequence 1 tokens 0..3 and keeps 1, sequence 2
    # tokens 0..2 and keeps all 3.
    meta = make_metadata(cache, tables, jnp.array([0, 3, 7, 10]), jnp.array([8, 4, 3]), num_tokens=11,
                         record_positions=4)
    x = jnp.concatenate([xs[0, 5:8], xs[1, :4], xs[2, :3], jnp.zeros((1, 16))])
    _, cache = mixer.paged(x, cache, meta)
    cache = commit_accepted(mixer, cache, meta, jnp.array([2, 1, 3]))
    for block, seq, n in ((1, 0, 7), (2, 1, 1), (3, 2, 3)):
        got = read_mamba_state(cache, "m", jnp.array([[block]]))
        for g, want in zip(got, mixer.dense_state(xs[seq], n)):
            np.testing.assert_allclose(np.asarray(g[0]), np.asarray(want), atol=1e-5, rtol=1e-5)
