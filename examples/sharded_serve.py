"""Serve a tiny model tensor-parallel over a (data, model) mesh, and check it against one device.

    python examples/sharded_serve.py [--data 1] [--model 4] [--smoke]
    # past one host: the same command in every process, plus
    #   --coordinator host0:1234 --num-processes N --process-id I

On a CPU-only machine the script asks XLA for 8 host devices (set ``XLA_FLAGS`` yourself to change that).
The model is tiny-gpt-oss with 8 query and 4 KV heads, so its KV pool splits by KV head when the
``model`` axis has 2 or 4 devices and is replicated otherwise.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPU only; GPUs are real

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hkv_jax.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from hkv_jax.models.presets import resolve_model  # noqa: E402
from hkv_jax.models.tiny import TinyConfig, TinyLM  # noqa: E402
from hkv_jax.sharding import make_mesh  # noqa: E402


def serve(mesh, new_tokens: int) -> list[list[int]]:
    """Four requests sharing a prefix, served under ``mesh`` (``None``: one device); their tokens."""
    config = {**resolve_model("tiny-gptoss")[1], "num_attention_heads": 8, "num_key_value_heads": 4}
    engine = Engine(TinyLM(TinyConfig.from_hf(config), nnx.Rngs(0)),
                    # one token bucket: the step compiles once per mesh (docs/sharding.md's snippet: the same sizes)
                    EngineConfig(num_blocks=64, block_size=8, max_requests=4, max_model_len=96, token_budget=32,
                                 token_buckets=(32,)),
                    mesh=mesh)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 24).tolist()
    rids = [engine.add_request(system + rng.integers(0, 256, n).tolist(), SamplingParams(max_new_tokens=new_tokens))
            for n in (5, 30, 12, 1)]
    out = engine.run()
    if mesh is not None and jax.process_index() == 0:
        layout = engine.state.cache.layout
        print(f"mesh {dict(mesh.shape)}: pool parts per shared tensor {list(layout.shards)}, "
              f"{layout.bytes_per_device() / 2**10:.0f} KiB of KV per device "
              f"({layout.total_bytes / 2**10:.0f} KiB in all); "
              f"{engine.stats.cache_hit_tokens} cache-hit tokens")
    return [out[r] for r in rids]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=int, default=1)
    ap.add_argument("--model", type=int, default=4)
    ap.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="the smallest run: 3 new tokens per request")
    args = ap.parse_args(argv)
    new_tokens = 3 if args.smoke else args.max_new_tokens
    if args.coordinator:  # before anything touches a device
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used only by CPU devices
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    sharded = serve(make_mesh(args.data, args.model), new_tokens)
    if jax.process_count() == 1:  # the single-device reference needs no collectives
        single = serve(None, new_tokens)
        print("tokens equal to one device:", sharded == single)
        if sharded != single:
            raise SystemExit("the mesh's tokens differ from one device's")
    if jax.process_index() == 0:
        print("tokens:", sharded)


if __name__ == "__main__":
    main()
