"""The tiny Mamba-2 mixer: its three computations of the same recurrence agree; bad configs are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv_jax.engine import Engine
from hkv_jax.models.mamba2 import Mamba2, Mamba2Config
from hkv_jax.models.presets import resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM


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
