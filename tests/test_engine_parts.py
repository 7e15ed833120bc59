"""The engine's host parts on their own: ``SamplingParams``, the stop rule and its device mirror, the
``Scheduler`` (no model built), and the named ``StepReport``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_jax.engine import FinishReason, SamplingParams, Scheduler, StepReport, check_stop
from hkv_jax.engine.request import may_stop
from hkv_jax.engine.step_messages import REPORT_ROWS


def test_sampling_params_are_checked_once_when_built_and_against_the_engine():
    p = SamplingParams(max_new_tokens=4, temperature=1, top_k=np.int64(3), stop=[7, 7, 9], stop_strings="END",
                       logit_bias={5: 2}, min_tokens=2, top_logprobs=1)
    assert (p.temperature, p.top_k, p.stop, p.stop_strings, p.logprobs) == (1.0, 3, (7, 7, 9), ("END",), True)
    assert type(p.top_k) is int and type(p.temperature) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0
    assert p.bias_entries(vocab_size=16, max_logit_bias=3) == ((5, 2.0), (7, -np.inf), (9, -np.inf))
    for bad, message in (({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
                         ({"temperature": -1}, "temperature must be finite and >= 0"),
                         ({"top_p": 0}, "top_p must be in (0, 1]"), ({"top_k": 1.5}, "top_k must be an integer"),
                         ({"seed": 2**31}, "seed must be an integer in [0, 2**31)"),
                         ({"stop_strings": ("",)}, "stop_strings must be non-empty strings"),
                         ({"min_tokens": 5}, "min_tokens must be an integer in [0, max_new_tokens]"),
                         ({"logit_bias": [(1, 1.0)]}, "logit_bias must be a dict")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("*", r"\*")):
            SamplingParams(**{"max_new_tokens": 4, **bad})
    with pytest.raises(ValueError, match="max_logit_bias 2"):
        p.check(vocab_size=16, max_top_logprobs=1, max_logit_bias=2, can_detokenize=True)
    with pytest.raises(ValueError, match="need the engine's detokenize"):
        p.check(vocab_size=16, max_top_logprobs=1, max_logit_bias=3, can_detokenize=False)
    with pytest.raises(ValueError, match=r"maps tokens in \[0, 4\)"):
        p.bias_entries(vocab_size=4, max_logit_bias=3)
    assert SamplingParams.from_dict(p.to_dict()) == p


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(0, 9),
                          st.lists(st.integers(0, 9), max_size=3)), min_size=1, max_size=8))
def test_the_device_loops_early_exit_mirrors_the_host_stop_rule(lanes):
    """Per lane (max_new_tokens, tokens generated, last token, stop ids): the device flags every lane whose
    request the host stops, and flags no other lane when the batch shares one stop list."""
    lanes = [(m, min(g, m - 1) + 1, t, tuple(s)) for m, g, t, s in lanes]  # g >= 1 tokens generated, <= m
    union = np.array(sorted({t for *_, s in lanes for t in s}) or [-1], np.int32)
    left = np.array([m - g for m, g, _, _ in lanes])
    last = np.array([t for _, _, t, _ in lanes], np.int32)
    flagged = np.asarray(may_stop(jnp.asarray(left), jnp.asarray(last), jnp.asarray(union), jnp))
    assert flagged.tolist() == may_stop(left, last, union).tolist()  # the host's numpy form agrees
    host = [check_stop(SamplingParams(max_new_tokens=m, stop=s), g, t) for m, g, t, s in lanes]
    assert all(flagged[i] for i, reason in enumerate(host) if reason is not None)
    shared = [check_stop(SamplingParams(max_new_tokens=m, stop=tuple(union.tolist())), g, t)
              for m, g, t, _ in lanes]
    assert flagged.tolist() == [reason is not None for reason in shared]


def test_check_stop_names_the_reason():
    p = SamplingParams(max_new_tokens=3, stop=(2,))
    assert check_stop(p, 1, 5) is None
    assert check_stop(p, 1, 2) == FinishReason.STOP == "stop"
    assert check_stop(p, 3, 5) == FinishReason.LENGTH
    assert check_stop(p, 1, 5, stop_string="END") == FinishReason.STOP


def _scheduler(**kw) -> Scheduler:
    return Scheduler(**{"max_requests": 3, "token_budget": 8, "block_size": 4, "num_blocks": 16, **kw})


def _run(s: Scheduler, out, refused=()) -> None:
    """What the engine does with a plan when every lane but ``refused`` gets its tokens."""
    s.sent(out)
    for i, r in enumerate(out.requests):
        if r.rid in refused:
            continue
        if i >= out.num_running:
            s.start(r)
        r.computed += int(out.num_tokens[i])
        if r.computed == r.total:  # it sampled a token
            r.generated.append(0)
    if refused:
        s.handle_refusals([(rid, int(out.num_tokens[out.request_ids.index(rid)])) for rid in refused])


def test_the_scheduler_plans_decodes_first_then_chunks_within_the_budget():
    s = _scheduler()
    p = SamplingParams(max_new_tokens=4)
    a, b, c, d = (s.add(list(range(n)), p) for n in (6, 10, 3, 2))
    out = s.schedule()
    assert out.request_ids == [a, b] and out.num_tokens[:2].tolist() == [6, 2] and out.admitted == [a, b]
    assert out.changes.lens[:2].tolist() == [6, 10] and out.num_running == 0 and out.slots[:2].tolist() == [0, 1]
    _run(s, out)  # a sampled its first token: it decodes now
    out = s.schedule()  # decoding first (a), then b's chunk: the budget is spent before c
    assert out.request_ids == [a, b] and out.num_tokens[:2].tolist() == [1, 7] and not out.admitted
    assert out.num_decoding == 1 and out.num_running == 2 and out.changes is None
    assert s.free_slot() == 2 and s.waiting == [c, d]


def test_a_refused_running_request_preempts_the_latest_and_holds_admissions():
    s = _scheduler(token_budget=32)
    p = SamplingParams(max_new_tokens=4)
    a, b = s.add([1] * 5, p), s.add([2] * 5, p)
    _run(s, s.schedule())
    c = s.add([3] * 5, p)
    out = s.schedule()
    assert out.request_ids == [a, b, c] and out.admitted == [c]
    _run(s, out, refused=(a,))  # a running request refused: the latest admitted (c) makes room
    assert s.running == [a, b] and s.waiting == [c] and s.requests[c].preemptions == 1
    assert s.requests[c].computed == 0 and s.to_preempt == [s.requests[c].slot] and s.hold_admissions
    out = s.schedule()
    assert out.request_ids == [a, b] and not s.hold_admissions  # no admission the step after


def test_abort_and_finish_free_the_slot_and_forget_needs_a_finished_request():
    s = _scheduler()
    p = SamplingParams(max_new_tokens=4)
    a, b = s.add([1] * 3, p), s.add([2] * 3, p)
    _run(s, s.schedule())
    slot = s.requests[a].slot
    with pytest.raises(ValueError, match="is not done"):
        s.forget(a)
    assert s.abort(a) and not s.abort(a) and s.to_free == [slot] and s.requests[a].aborted
    assert s.forget(a).finish_reason == FinishReason.ABORT
    with pytest.raises(KeyError, match="no request 99"):
        s.abort(99)
    s.finish(s.requests[b], FinishReason.LENGTH, 0.0)
    assert not s.running and s.requests[b].done and s.has_work  # its blocks are freed by the next step


def test_engine_requests_is_a_read_only_view_that_books_what_it_shows():
    """``Engine.requests`` is a ``RequestsView``: each read goes through the scheduler's booking (a
    decode-only run's tokens are booked when read, not when the property is taken), and it cannot be
    written to (the scheduler owns request state)."""
    from hkv_jax.engine.request import RequestsView

    s = _scheduler()
    rid = s.add([1] * 3, SamplingParams(max_new_tokens=4))
    reads = []

    def booked():
        reads.append(1)
        return s.requests

    view = RequestsView(booked)
    assert not reads  # taking the view books nothing
    assert view[rid] is s.requests[rid] and list(view) == [rid] and len(view) == 1 and rid in view
    assert len(reads) >= 3 and dict(view) == s.requests
    with pytest.raises(TypeError):
        view[rid] = None  # noqa - read-only
    with pytest.raises(KeyError):
        view[rid + 1]


def test_mamba_chunks_stop_at_block_boundaries():
    s = _scheduler(align=True, token_budget=16)
    rid = s.add([1] * 11, SamplingParams(max_new_tokens=2))
    r = s.requests[rid]
    r.max_chunk = 6
    out = s.schedule()
    assert out.num_tokens[0] == 6
    _run(s, out)
    assert s.schedule().num_tokens[0] == 2  # from 6 to the boundary at 8


def test_step_reports_are_read_by_name():
    n, N = 3, 2
    data = np.zeros((2, len(REPORT_ROWS) + 2 * N, n), np.int32)
    data[:, REPORT_ROWS.index("ok")] = 1
    data[:, REPORT_ROWS.index("num_new")] = 1
    data[:, REPORT_ROWS.index("sampled")] = [[1, 1, 1], [1, 0, 1]]
    data[:, REPORT_ROWS.index("tokens")] = [[4, 5, 6], [7, -1, 9]]
    data[:, REPORT_ROWS.index("logprob")] = np.float32(-0.5).view(np.int32)
    data[:, len(REPORT_ROWS) + N:] = np.float32(-1.25).view(np.int32)
    report = StepReport(data)
    assert report.tokens.tolist() == [[4, 5, 6], [7, -1, 9]] and report.clean_decodes().tolist() == [True, False]
    assert report.logprob.tolist() == [[-0.5] * 3] * 2 and report.top_logprobs.shape == (2, N, n)
    assert (report.top_logprobs == -1.25).all() and len(report.steps(slice(1))) == 1


def _imports(module: str) -> set[str]:
    """Every module of this project that ``module`` imports, directly or through another (read from the
    source, not run: the package ``__init__`` files, which import everything, are not followed)."""
    import ast
    import importlib.util

    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name.split(".")[0] not in ("hkv_jax", "kernels_pallas", "flax"):
            continue
        seen.add(name)
        spec = importlib.util.find_spec(name)
        if name.startswith("flax") or spec is None or spec.origin.endswith("__init__.py"):
            continue
        for node in ast.walk(ast.parse(open(spec.origin).read())):
            if isinstance(node, ast.ImportFrom) and node.module:
                todo.append(node.module)
            elif isinstance(node, ast.Import):
                todo.extend(a.name for a in node.names)
    return seen


def test_the_scheduler_imports_without_jax_and_the_layers_no_kernel_oracle_for_positions():
    """The scheduler is host code: it reaches neither the step program, the models nor the kernels (its
    message to the runner, ``Changes``, lives on its own); the step, attention and recurrent layers read
    the ragged batch's positions from ``kernels_pallas.positions``."""
    scheduler = _imports("hkv_jax.engine.scheduler")
    assert "hkv_jax.engine.changes" in scheduler
    assert not {m for m in scheduler if m.startswith(("hkv_jax.engine.step", "flax", "kernels_pallas"))}, scheduler
    for module in ("hkv_jax.engine.step", "hkv_jax.attention", "hkv_jax.recurrent"):
        assert "kernels_pallas.positions" in _imports(module), module
    # With jax missing altogether, the scheduler still imports (through the package's lazy names).
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['jax'] = None\n"
                           "from hkv_jax.engine.scheduler import Scheduler, SchedulerOutput\n"
                           "from hkv_jax.engine import SamplingParams\n"
                           "assert not [m for m in sys.modules if m.startswith(('jax.', 'flax', 'kernels_pallas'))]"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_sampling_value_is_a_declared_attribute_of_engines_and_requests():
    """The engine's defaults (settable) and a request's values (read from its params) are declared, one per
    ``KNOBS`` entry, so that a knob added there and not here fails."""
    from hkv_jax.engine import Engine
    from hkv_jax.engine.request import ParamsValue, Request
    from hkv_jax.engine.sampling_params import ENGINE_DEFAULTS, KNOBS, EngineDefault

    assert {n for n, v in vars(Engine).items() if isinstance(v, EngineDefault)} == set(ENGINE_DEFAULTS)
    assert {n for n, v in vars(Request).items() if isinstance(v, ParamsValue)} == {k.name for k in KNOBS}
    r = Request(0, [1, 2], SamplingParams(max_new_tokens=3, temperature=0.5, top_k=4))
    assert (r.temperature, r.top_k, r.seed) == (0.5, 4, None)

    class Holder:
        temperature = EngineDefault()

        def __init__(self):
            self.sampling_defaults = dict(ENGINE_DEFAULTS)

    h = Holder()
    h.temperature = 0.7
    assert h.temperature == h.sampling_defaults["temperature"] == 0.7
    with pytest.raises(TypeError, match="not an engine sampling default"):
        type("Bad", (), {"seed": EngineDefault()})


def test_a_knob_added_to_the_listing_reaches_every_sampling_surface(monkeypatch):
    """``hkv generate``'s flags, ``GenerateConfig`` and the HTTP protocol's fields come from ``KNOBS``: a knob
    added to a copy of it (with its ``SamplingParams`` field) is taken, and checked, on each of them."""
    from dataclasses import make_dataclass
    from types import SimpleNamespace

    import hkv_jax.cli as cli
    import hkv_jax.generate as generate
    from hkv_jax.engine import sampling_params
    from hkv_jax.serve import protocol

    knob = sampling_params.Knob("typical_p", np.float32, 1.0, lambda x: sampling_params.is_number(x) and 0 < x <= 1,
                                "in (0, 1]", "typical sampling mass")
    Params = make_dataclass("SamplingParams", [("typical_p", float | None, None)], bases=(SamplingParams,),
                            frozen=True)
    extended = sampling_params.KNOBS + (knob,)
    for module in (sampling_params, cli, generate, protocol):
        monkeypatch.setattr(module, "KNOBS", extended)
    for module in (generate, protocol):
        monkeypatch.setattr(module, "SamplingParams", Params)

    def generate_config(*flags):
        return cli._generate_config(cli.build_parser().parse_args(["generate", "a prompt", *flags]))

    cfg = generate_config("--typical-p", "0.5", "--top-k", "3")
    assert cfg.sampling["typical_p"] == 0.5 and cfg.params().typical_p == 0.5 and cfg.params().top_k == 3
    assert generate_config().params().typical_p == 1.0  # the knob's neutral value
    with pytest.raises(cli.CliError, match=r"--typical-p must be in \(0, 1\], got 2.0"):
        generate_config("--typical-p", "2")
    with pytest.raises(ValueError, match="sampling: unknown typical_q"):
        generate.GenerateConfig(sampling={"typical_q": 0.5}).params()

    codec = SimpleNamespace(encode=lambda text: [ord(c) for c in text], eos_ids=(1,))
    limits = protocol.Limits(max_requests=2, max_model_len=64, max_top_logprobs=0)
    got = protocol.parse({"prompt": "hi", "max_tokens": 2, "typical_p": 0.25, "top_p": 0.5}, False, codec, None, limits)
    assert (got.params.typical_p, got.params.top_p, got.params.temperature) == (0.25, 0.5, 1.0)
    assert protocol.parse({"prompt": "hi", "max_tokens": 2}, False, codec, None, limits).params.typical_p is None
    with pytest.raises(ValueError, match=r"typical_p must be in \(0, 1\]"):
        protocol.parse({"prompt": "hi", "max_tokens": 2, "typical_p": 0}, False, codec, None, limits)


def test_engine_config_fills_the_sizes_left_out_by_the_models_rule_and_configs_name_engine_fields():
    """``factory.engine_config``: a tiny model's sizes (256 tokens, 160 blocks, one bucket), another model's
    pool for ``max_requests`` requests of ``max_model_len`` (a sliding window's chunk counted), given sizes
    kept; ``ServeConfig`` and ``GenerateConfig`` refuse a name that is not an ``EngineConfig`` field."""
    from types import SimpleNamespace

    from hkv_jax.engine.factory import ServeConfig, engine_config
    from hkv_jax.generate import GenerateConfig
    from hkv_jax.models.tiny import TinyLM
    from hkv_jax.planner import plan
    from hkv_jax.spec import FullAttentionSpec, SlidingWindowSpec

    layers = [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8, dtype="float32"),
              SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, dtype="float32", sliding_window=32)]
    other = SimpleNamespace(cfg=SimpleNamespace(layers=layers))
    cfg = engine_config(other, max_requests=3, token_budget=16, num_blocks=None)
    per_request = plan(layers, block_size=16, num_blocks=2).blocks_per_request(512, chunk=16)
    assert (cfg.max_model_len, cfg.num_blocks, cfg.token_buckets) == (512, 1 + 3 * per_request, None)
    assert engine_config(other, num_blocks=7, max_model_len=40).num_blocks == 7
    tiny = TinyLM.__new__(TinyLM)  # the rule reads the type only
    cfg = engine_config(tiny, token_budget=32, token_buckets=None)
    assert (cfg.max_model_len, cfg.num_blocks, cfg.token_buckets) == (256, 160, None)  # None: the default buckets
    assert engine_config(tiny, token_budget=32).token_buckets == (32,)
    for make in (lambda e: ServeConfig(engine=e), lambda e: GenerateConfig(engine=e),
                 lambda e: engine_config(tiny, **e)):
        with pytest.raises(ValueError, match="unknown engine field.* num_block; EngineConfig has num_blocks"):
            make({"num_block": 8})
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, .* got 'fp4'"):
        engine_config(tiny, kv_cache_dtype="fp4")
