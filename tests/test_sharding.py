"""Serving over a mesh: the KV pool split by KV head, tensor-parallel weights, one and two processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from hkv_jax.cache import CacheLayout, init_cache, layer_kv, set_layer_kv
from hkv_jax.cli import main as cli
from hkv_jax.planner import plan
from hkv_jax.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

HERE = Path(__file__).parent
MODEL = "tiny-gptoss-8x4"  # 8 query heads, 4 KV heads: its pool splits over 4 devices, not over 8
# In one process of 8 devices (1x1: no mesh, the reference); the 2x4 mesh runs over two processes.
# The data axis only replicates: 2x4 (over two processes) covers it, so no 8x1 run.
MESHES = ("1x1", "1x8")
INT8_MODEL = "tiny-gemma3-8x4-int8"  # 8 query heads, 4 KV heads, no biases: int8 weights split like float ones


def test_a_split_page_holds_each_devices_heads_in_the_unsplit_layout():
    layers = [FullAttentionSpec(name=f"f{i}", num_kv_heads=4, head_size=8, dtype="float32") for i in range(2)]
    config = plan(layers, block_size=4, num_blocks=6)
    layout = CacheLayout.from_config(config, model_shards=2)
    assert layout.shards == (2, 2) and layout.bytes_per_device() == config.total_bytes // 2
    cache = init_cache(config)
    cache = type(cache)(cache.buffers, layout)
    view = np.arange(6 * 2 * 4 * 4 * 8, dtype=np.float32).reshape(6, 2, 4, 4, 8)
    cache = set_layer_kv(cache, "f1", view)
    np.testing.assert_array_equal(np.asarray(layer_kv(cache, "f1")), view)
    words = np.asarray(cache.buffers[layout.slot("f1").tensor]).view(np.float32).reshape(6, 2, -1)  # [page, part, ...]
    for part in range(2):
        np.testing.assert_array_equal(words[:, part].reshape(6, 2, 2, 4, 8), view[:, :, 2 * part:2 * part + 2])


@pytest.mark.parametrize("layers", [
    # A layer of one KV head, or a Mamba state, keeps its tensor whole; 4 KV heads split 4 ways.
    [SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, dtype="float32", sliding_window=8),
     FullAttentionSpec(name="f", num_kv_heads=4, head_size=8, dtype="float32")],
    [FullAttentionSpec(name="f", num_kv_heads=4, head_size=8, dtype="float32"),
     MambaSpec(name="m", shapes=((4, 8),), dtypes=("float32",))],
])
def test_tensors_holding_an_unsplittable_layer_stay_whole(layers):
    config = plan(layers, block_size=4, policy="min-waste", num_blocks=6)
    layout = CacheLayout.from_config(config, model_shards=4)
    for t in range(layout.num_tensors):
        kinds = {(type(s.spec).__name__, getattr(s.spec, "num_kv_heads", 0)) for _, s in layout.slots if s.tensor == t}
        splittable = all(k == "FullAttentionSpec" and h % 4 == 0 for k, h in kinds)
        assert layout.tensor_shards(t) == (4 if splittable else 1), kinds
    assert 1 in layout.shards
    with pytest.raises(ValueError, match="model_shards"):
        CacheLayout.from_config(config, model_shards=0)


def test_int8_scales_split_with_their_columns():
    from flax import nnx
    from test_gemma3 import SMALL, _small_checkpoint

    from hkv_jax.models.gemma3 import Gemma3Config
    from hkv_jax.models.quant import quantize_model
    from hkv_jax.models.weights import build_gemma3
    from hkv_jax.sharding import _path_names, param_spec

    cfg = Gemma3Config.from_hf(SMALL)  # 4 query heads, 2 KV heads, intermediate size 48
    model = quantize_model(build_gemma3(cfg, _small_checkpoint(np.random.default_rng(0))), "int8")
    specs = {"/".join(_path_names(path)): param_spec(path, x.shape, cfg, 2)
             for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
    P = jax.sharding.PartitionSpec
    # Int8Linear.weight is [out, in]: a column split (of the outputs) splits its first dimension.
    want = {"q_proj": (P("model", None), P("model")), "k_proj": (P("model", None), P("model")),
            "up_proj": (P("model", None), P("model")), "o_proj": (P(None, "model"), P()),
            "down_proj": (P(None, "model"), P())}
    for name, (weight, scale) in want.items():
        got = {k.rsplit("/", 1)[1]: v for k, v in specs.items() if f"/{name}/" in k and k.startswith("layers/0/")}
        assert got == {"weight": weight, "scale": scale}, (name, got)
    assert specs["lm_head/scale"] == P() and specs["lm_head/weight"] == P()


def test_plan_tp_reports_what_one_device_holds(capsys):
    assert cli(["plan", "llama-3.1-8b", "--memory", "10GiB", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli(["plan", "llama-3.1-8b", "--memory", "10GiB", "--tp", "8", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)
    tp = eight["tensor_parallel"]
    assert tp["devices"] == 8 and tp["split_layer_slots"] == tp["layer_slots"] == 32
    assert tp["bytes_per_device"] <= 10 * 2**30 and eight["plan"]["num_blocks"] == 8 * one["plan"]["num_blocks"]
    assert cli(["plan", "gemma-3-270m", "--memory", "1GiB", "--tp", "4"]) == 0  # one KV head: nothing splits
    assert "0 of 3 layer slots split" in capsys.readouterr().out
    assert cli(["plan", "gemma-3-270m", "--tp", "0"]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_sharded_engine_equals_one_device_in_one_process_and_across_two(tmp_path):
    """8 host devices in one process (mesh 1x8 against no mesh), and a 2x4 mesh (the pool split 4
    ways) over two processes of 4 devices each (``jax.distributed``, gloo): same tokens, logits, allocator
    state. A fourth process serves a model with int8 weights on 1x8 against no mesh (``INT8_MODEL``)."""
    def start(args, devices, name):  # each process dumps its step programs for sharded_serve to read
        flags = (f"--xla_force_host_platform_device_count={devices} --xla_dump_to={tmp_path / name} "
                 "--xla_dump_hlo_module_re=jit_step")
        env = dict(os.environ, XLA_FLAGS=flags,
                   PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a program loaded from the run's cache is not dumped
        return subprocess.Popen([sys.executable, *map(str, args)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    port = _free_port()
    procs = [start([HERE / "sharded_serve.py", MODEL, *MESHES, "--attention"], 8, "float"),
             start([HERE / "sharded_serve.py", INT8_MODEL, *MESHES], 8, "int8")] + [
        start([HERE / "distributed_serve.py", i, port, MODEL, "2x4", tmp_path / "two.json"], 4, f"two{i}")
        for i in (0, 1)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    print(outs[0][1], outs[1][1])
    runs = json.loads(outs[0][0])
    runs["2x4 over 2 processes"] = json.loads((tmp_path / "two.json").read_text())
    int8_runs = json.loads(outs[1][0])

    for heads, (out_err, pool_err) in runs.pop("attention").items():  # one layer, mesh 2x4
        assert out_err < 1e-5 and pool_err < 1e-6, heads
    # An int8 model rounds its activations to int8 steps (1/127 of each row's peak). Under a mesh XLA may
    # compile the float parts around the products differently (it did on an AMD EPYC, not on a Xeon), and
    # a value at a rounding step then moves by one step (hkv_jax/models/quant.py): its logits agree to a
    # few steps (the largest gap seen: 0.033, on logits of a few units), its tokens and allocator exactly.
    for model, model_runs, split, rel in ((MODEL, runs, {"1": 0, "4": 8 * 4, "8": 6 * 4}, 0.0),
                                          # q, o, gate, up, down, and the scales of the column-split q, gate, up
                                          (INT8_MODEL, int8_runs, {"1": 0, "8": 8 * 6}, 0.03)):
        base = model_runs["1x1"]
        assert base["preemptions"] > 0 and base["hits"] > 0, model
        for name, run in model_runs.items():
            assert run["tokens"] == base["tokens"], (model, name)
            for got, want in zip(run["logits"], base["logits"]):
                atol = max(1e-4, rel * np.abs(want).max())
                np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"{model} {name}")
            assert run["alloc"] == base["alloc"], (model, name)
            # The pool splits where the model axis divides the 4 KV heads.
            assert set(run["shards"]) == ({4} if name.startswith("2x4") else {1}), (model, name)
            # Per layer: q, k, v, o, sinks, gate, up, down; the 4 KV heads' k and v do not split 8 ways.
            assert run["split_weights"] == split[name[2]], (model, name)
            # The programs read are the ones compiled for this mesh; under a mesh the split weights' partial
            # products are summed (all-reduce), and nothing else moves between the devices: no all-gather
            # rebuilds pages of the pool, split or replicated, and no product of several layers' split columns
            # (Q/K/V, gate/up) moves or gathers its outputs (models.layers.projected_heads).
            one = name == "1x1"
            assert run["partitions"] == [1 if one else 8], (model, name)
            assert (run["all_reduces"] == 0) == one, (model, name)
            assert run["moves"] == [], (model, name)
