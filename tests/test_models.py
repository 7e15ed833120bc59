import pytest

from hkv_jax.models import layers_from_hf_config, load_preset, model_layers, preset_names
from hkv_jax.spec import KVSharingSpec

EXPECTED = {  # preset: (layers, {kind: count})
    "llama-3.1-8b": (32, {"full": 32}),
    "gemma-2-9b": (42, {"sliding_window": 21, "full": 21}),
    "gemma-3-1b": (26, {"sliding_window": 22, "full": 4}),
    "gemma-3-27b": (62, {"sliding_window": 52, "full": 10}),
    "gemma-3n-e4b": (35, {"sliding_window": 16, "full": 4, "kv_sharing": 15}),
    "gpt-oss-20b": (24, {"sliding_window": 12, "full": 12}),
    "gpt-oss-120b": (36, {"sliding_window": 18, "full": 18}),
    "llama-4-scout-17b-16e": (48, {"chunked_local": 36, "full": 12}),
    "ministral-8b": (36, {"sliding_window": 27, "full": 9}),
    "jamba-mini-1.5": (32, {"mamba": 28, "full": 4}),
    "qwen3-next-80b-a3b": (48, {"mamba": 36, "full": 12}),
    "granite-4.0-h-small": (40, {"mamba": 36, "full": 4}),
    "gemma-4-31b": (60, {"sliding_window": 50, "full": 10}),
    "gemma-4-26b-a4b": (30, {"sliding_window": 25, "full": 5}),
    "gemma-4-e4b": (42, {"sliding_window": 20, "full": 4, "kv_sharing": 18}),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_real_presets_have_the_published_layer_mix(preset):
    layers = model_layers(preset)
    n, mix = EXPECTED[preset]
    assert len(layers) == n
    got = {}
    for l in layers:
        got[l.kind] = got.get(l.kind, 0) + 1
    assert got == mix
    assert "_source" in load_preset(preset)


def test_every_preset_builds():
    assert set(EXPECTED) <= set(preset_names())
    for name in preset_names():
        assert model_layers(name)


def test_state_sizes_of_recurrent_presets():
    jamba = model_layers("jamba-mini-1.5")[0]
    assert jamba.state_bytes == (3 * 8192 + 8192 * 16) * 2  # Mamba-1: conv + SSM, bf16
    qwen = model_layers("qwen3-next-80b-a3b")[0]
    assert qwen.shapes == ((3, 8192), (32, 128, 128))  # Gated DeltaNet
    granite = model_layers("granite-4.0-h-small")[0]
    assert granite.shapes == ((3, 8448), (128, 64, 128))  # Mamba-2


def test_gemma3n_shared_layers_point_at_the_last_unshared_layer_of_their_kind():
    layers = model_layers("gemma-3n-e4b")
    shared = [l for l in layers if isinstance(l, KVSharingSpec)]
    assert {l.target for l in shared} == {"model.layers.18", "model.layers.19"}
    assert next(l for l in shared if l.name == "model.layers.24").target == "model.layers.19"


@pytest.mark.parametrize("preset, sliding, full", [("gemma-4-31b", (16, 256), (4, 512)),
                                                   ("gemma-4-26b-a4b", (8, 256), (2, 512)),
                                                   ("gemma-4-e4b", (2, 256), (2, 512))])
def test_gemma4_full_layers_have_their_own_kv_shape(preset, sliding, full):
    """Gemma 4: ``global_head_dim`` and ``num_global_key_value_heads`` shape the full layers' KV (absent: the
    sliding layers'); ``attention_k_eq_v`` changes no page."""
    shapes = {(l.kind, l.num_kv_heads, l.head_size) for l in model_layers(preset) if not isinstance(l, KVSharingSpec)}
    assert shapes == {("sliding_window", *sliding), ("full", *full)}
    config = load_preset(preset)
    assert layers_from_hf_config({**config, "text_config": {**config["text_config"], "attention_k_eq_v": True}}) == \
        layers_from_hf_config({**config, "text_config": {**config["text_config"], "attention_k_eq_v": False}})
    with pytest.raises(ValueError, match="attention_k_eq_v"):
        layers_from_hf_config({**config, "text_config": {**config["text_config"], "attention_k_eq_v": "yes"}})


def test_gemma4_e4b_shared_layers_read_the_last_earlier_layer_of_their_kind():
    layers = model_layers("gemma-4-e4b")
    shared = {l.name: l.target for l in layers if isinstance(l, KVSharingSpec)}
    assert sorted(shared, key=lambda n: int(n.split(".")[-1])) == [f"model.layers.{i}" for i in range(24, 42)]
    assert set(shared.values()) == {"model.layers.22", "model.layers.23"}  # last sliding, last full before 24
    assert shared["model.layers.29"] == "model.layers.23" and shared["model.layers.24"] == "model.layers.22"


def test_dtype_override_and_float32_served_as_bfloat16():
    assert model_layers("gemma-2-9b")[0].dtype == "bfloat16"
    assert model_layers("gemma-2-9b", dtype="float32")[0].bytes_per_token == 2 * 8 * 256 * 4


@pytest.mark.parametrize(
    "config, message",
    [
        ({}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "2 layers"),
        (
            {"num_hidden_layers": 1, "layer_types": ["weird"], "num_attention_heads": 1, "hidden_size": 8},
            "unknown layer type",
        ),
        (
            {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "num_attention_heads": 2, "hidden_size": 8},
            "state fields",
        ),
        ([1, 2], "JSON object"),
    ],
)
def test_malformed_configs_raise_value_error(config, message):
    with pytest.raises(ValueError, match=message):
        layers_from_hf_config(config)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("gpt-5")


@pytest.mark.parametrize("name", ["gemma3", "tiny-jamba", "tiny-gemma4"])
def test_a_single_token_run_as_two_rows_as_on_a_gpu_gives_the_same_logits_and_pages(name, monkeypatch):
    """On a GPU a batch-1 decode step runs its dense layers on two rows (``layers.gemm_rows``) and no Linear
    pads its own input; the padding row writes no page, moves no Mamba state and changes no logit. Gemma 3,
    attention + Mamba-2, and KV sharing with keys as values."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from test_gemma3 import SMALL

    from hkv_jax.attention import make_metadata
    from hkv_jax.cache import init_cache
    from hkv_jax.models import layers
    from hkv_jax.models.gemma3 import Gemma3Config, Gemma3LM
    from hkv_jax.models.presets import resolve_model
    from hkv_jax.models.tiny import TinyConfig, TinyLM
    from hkv_jax.planner import plan

    model = (Gemma3LM(Gemma3Config.from_hf(SMALL), nnx.Rngs(0)) if name == "gemma3"
             else TinyLM(TinyConfig.from_hf(resolve_model(name)[1]), nnx.Rngs(0)))
    config = plan(model.cfg.layers, block_size=8, policy="vllm", num_blocks=8)
    tables = [jnp.array([[1 + 2 * g, 2 + 2 * g]]) for g in range(len(config.groups))]
    tokens = jnp.array([3, 1, 4, 1, 5, 9])

    def forward(cache, n, last):  # tokens [n - last, n) of the one sequence
        meta = make_metadata(cache, tables, jnp.array([0, last]), jnp.array([n]), num_tokens=last)
        run = jax.jit(lambda t, p, c, m: model.paged(t, p, c, m))
        return run(tokens[n - last:n], jnp.arange(n - last, n), cache, meta)

    _, prefilled = forward(init_cache(config), 5, 5)
    want, want_cache = forward(prefilled, 6, 1)
    padded = []
    monkeypatch.setattr(layers, "target_device", lambda: ("gpu", False))
    monkeypatch.setattr(layers, "two_rows_at_least", lambda product, x: padded.append(x.shape) or product(x))
    got, got_cache = forward(prefilled, 6, 1)
    assert not padded, "a Linear padded its own input: the model did not run its token as two rows"
    assert got.shape == want.shape == (1, model.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_cache.buffers, want_cache.buffers):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_fused_projections_equal_the_layers_one_by_one():
    """``Linear.fused`` and ``Int8Linear.fused`` (a model's Q, K and V as one product) give each layer's own
    output side by side, a single row too (two on a GPU); a layer with a bias is refused."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from hkv_jax.models import layers
    from hkv_jax.models.quant import Int8Linear

    rngs = nnx.Rngs(0)
    parts = tuple(layers.Linear(16, n, use_bias=False, rngs=rngs) for n in (8, 4, 4))
    quantized = tuple(Int8Linear(np.asarray(p.kernel[...])) for p in parts)
    for x in (jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)), jnp.float32), jnp.ones((1, 16))):
        for group in (parts, quantized):
            want = np.concatenate([np.asarray(p(x)) for p in group], axis=-1)
            np.testing.assert_allclose(np.asarray(type(group[0]).fused(group, x)), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="bias-free layers of one dtype"):
        layers.Linear.fused((parts[0], layers.Linear(16, 4, rngs=rngs)), x)
