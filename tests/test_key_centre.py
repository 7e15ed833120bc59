"""Key centring for fp8 pages (``hkv_jax.models.key_centre``): exact where it is used, smaller rounding error,
calibration, and the engines that calibrate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv_jax.engine.config import EngineConfig
from hkv_jax.engine.factory import engine_for, load_model
from hkv_jax.models.key_centre import KeyCentre, calibrate_key_centres, calibration_ids, centred, position_average
from hkv_jax.models.layers import dense_attention
from kernels_pallas.reference import to_page_dtype

FP8 = jnp.float8_e4m3fn


def qkv(seed: int = 0, length: int = 48, heads: int = 4, kv_heads: int = 2, dim: int = 16, offset: float = 30.0):
    """Random queries, keys whose channel 3 sits near ``offset`` (as Gemma's steady key channels do), values."""
    q, k, v = (jax.random.normal(key, (length, h, dim))
               for key, h in zip(jax.random.split(jax.random.key(seed), 3), (heads, kv_heads, kv_heads)))
    return q, k.at[..., 3].add(offset), v


@pytest.mark.parametrize("window", [None, 8])
def test_centring_is_exact_without_soft_cap_or_sinks(window):
    q, k, v = qkv()
    c = jax.random.normal(jax.random.key(1), k.shape[1:]) * 10
    attend = lambda keys, cap=None: dense_attention(q, keys, v, window=window, chunk=None,  # noqa: E731
                                                   soft_cap=cap, sinks=None)
    np.testing.assert_allclose(attend(k - c), attend(k), atol=2e-5)
    # Why a soft-capped layer keeps c = 0: tanh is not shift-invariant.
    assert np.abs(np.asarray(attend(k - c, 5.0) - attend(k, 5.0))).max() > 1e-3


def test_centred_keys_round_with_a_smaller_score_error():
    q, k, v = qkv()
    exact = dense_attention(q, k, v, window=None, chunk=None, soft_cap=None, sinks=None)
    c = k.mean(0)
    errors = [np.abs(np.asarray(dense_attention(q, to_page_dtype(keys, FP8).astype(jnp.float32), v, window=None,
                                                chunk=None, soft_cap=None, sinks=None) - exact)).max()
              for keys in (k, k - c)]
    assert errors[1] < errors[0] / 2, errors


def test_centred_only_over_fp8_pages():
    k = jnp.ones((3, 2, 4))
    c = KeyCentre(jnp.full((2, 4), 0.25))
    np.testing.assert_array_equal(centred(k, c, FP8), k - 0.25)
    for dtype in (jnp.bfloat16, jnp.float32):
        assert centred(k, c, dtype) is k
    assert centred(k, None, FP8) is k


def test_position_average():
    mean = jnp.ones((1, 8))
    np.testing.assert_array_equal(position_average(mean, None, 1000), mean)
    # Half-split RoPE, base 10,000 over 8 channels: pair 0 turns one radian a token and averages out over
    # 100,000 positions; pair 3 turns 10^-3 radians a token, about 1 radian over 1,000 positions (its
    # channels keep sin(1)/1 and (1 - cos 1)/1 of a unit mean).
    wide = np.asarray(position_average(mean, 10_000.0, 100_000))[0]
    assert abs(wide[0]) < 0.01 and abs(wide[4]) < 0.01
    short = np.asarray(position_average(mean, 10_000.0, 1_000))[0]
    np.testing.assert_allclose([short[3], short[7]], [np.sin(1) - (1 - np.cos(1)), np.sin(1) + (1 - np.cos(1))],
                               atol=0.01)


def test_calibration_sets_centres_only_where_exact():
    model, _ = load_model("tiny-gptoss")  # attention sinks: no layer takes a centre
    assert not jax.tree.leaves(nnx.state(model, KeyCentre))
    model, _ = load_model("tiny-gemma4")  # KV-sharing layers read their target's centred keys
    centres = [b.mixer.key_centre for b in model.blocks if hasattr(b.mixer, "key_centre")]
    assert [c is None for c in centres] == [not b.mixer.owns_kv for b in model.blocks if hasattr(b.mixer, "owns_kv")]
    calibrate_key_centres(model, calibration_ids(None), 256)
    assert all(np.abs(np.asarray(c[...])).max() > 0 for c in centres if c is not None)
    with pytest.raises(ValueError, match="calibration needs token ids"):
        calibrate_key_centres(model, [], 256)


def test_engine_for_calibrates_fp8_engines_only():
    sizes = dict(num_blocks=24, block_size=8, max_requests=1, max_model_len=64, token_budget=16)
    for dtype, calibrated in (("auto", False), ("fp8", True)):
        model, _ = load_model("tiny-llama4")
        engine_for(model, None, EngineConfig(kv_cache_dtype=dtype, **sizes))
        assert any(np.asarray(c).any() for c in jax.tree.leaves(nnx.state(model, KeyCentre))) == calibrated
