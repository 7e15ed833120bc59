"""Conformance: every trace of tests/data/traces replays exactly as vLLM 0.33 answered it (strict: block ids too)."""

import json
import subprocess
import sys

import pytest
from conftest import COMPARE, TRACES, load_trace, require_traces

from hkv_jax.allocator.replay import run_trace
from hkv_jax.cli import main

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_replay")


def test_there_are_traces():
    require_traces()


@pytest.mark.parametrize("engine", ["jax", "model"])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_trace_matches_vllm_strictly(path, engine, tmp_path):
    trace, _ = load_trace(path)
    out = tmp_path / "result.json"
    out.write_text(json.dumps(run_trace(trace, engine=engine)))
    proc = subprocess.run([sys.executable, str(COMPARE), str(path.with_suffix(".expected.json")), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_min_waste_policy_replays_identically_where_it_groups_alike():
    # min-waste differs from vllm only in grouping; where the groups coincide the replay must too.
    require_traces()
    same = 0
    for path in TRACES:
        trace, _ = load_trace(path)
        a, b = run_trace(trace, "vllm", "model"), run_trace(trace, "min-waste", "model")
        if a["kv_cache_config"]["groups"] == b["kv_cache_config"]["groups"]:
            same += 1
            assert a["events"] == b["events"], path.name
    assert same >= 3


def test_a_trace_whose_stated_block_sizes_differ_from_its_plan_is_refused():
    trace, _ = load_trace(next(p for p in TRACES if p.name.startswith("hetero_")))
    for key, value in (("scheduler_block_size", 48), ("hash_block_size", 8)):
        with pytest.raises(ValueError, match=f"the trace states {key} {value}"):
            run_trace({**trace, key: value}, engine="model")
    groups = [{**g, "block_size": 64} for g in trace["groups"]]
    with pytest.raises(ValueError, match="the trace states groups"):
        run_trace({**trace, "groups": groups}, engine="model")


def test_hkv_replay_cli(tmp_path, capsys):
    require_traces()
    out = tmp_path / "r.json"
    assert main(["replay", str(TRACES[0]), "-o", str(out), "--engine", "model"]) == 0
    assert json.loads(out.read_text())["events"]
    assert "events" in capsys.readouterr().out


def test_replay_bad_input(tmp_path, capsys):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"block_size": 16, "num_blocks": 8, "max_model_len": 64, "steps": [[{"op": "jump"}]],
                               "layers": [{"name": "a", "type": "full", "num_kv_heads": 1, "head_size": 8}]}))
    assert main(["replay", str(bad)]) == 2
    assert "unknown op" in capsys.readouterr().err
    bad.write_text(json.dumps({"block_size": 16, "num_blocks": 8, "max_model_len": 64,
                               "steps": [[{"op": "free", "id": "ghost"}]],
                               "layers": [{"name": "a", "type": "full", "num_kv_heads": 1, "head_size": 8}]}))
    assert main(["replay", str(bad)]) == 2
    assert "ghost" in capsys.readouterr().err
