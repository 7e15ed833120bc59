"""``hkv replay``: run a trace (``docs/trace-format.md``) through the allocator, write the result."""

from __future__ import annotations

import json
from typing import Any

from hkv_jax.allocator.kv_cache_manager import KVCacheManager
from hkv_jax.allocator.pymodel import PyAllocator
from hkv_jax.planner import plan
from hkv_jax.spec import layers_from_trace

OPS = ("add", "schedule", "free", "preempt", "reset_prefix_cache")
ENGINES = ("jax", "model")


def trace_config(trace: dict[str, Any], policy: str = "vllm"):
    """The ``KVCacheConfig`` a trace describes, planned under ``policy``."""
    for key in ("block_size", "num_blocks", "max_model_len", "steps"):
        if key not in trace:
            raise ValueError(f"trace has no {key!r}")
    cfg = plan(layers_from_trace(trace), block_size=trace["block_size"], policy=policy, num_blocks=trace["num_blocks"])
    if policy == "vllm":  # a trace with groups of different block sizes states vLLM's units and sizes: check them
        ours = {"hash_block_size": cfg.hash_block_size, "scheduler_block_size": cfg.scheduler_block_size}
        if "groups" in trace:
            ours["groups"] = [g.block_size for g in cfg.groups]
            trace = {**trace, "groups": [g.get("block_size") for g in trace["groups"]]}
        for key, value in ours.items():
            if key in trace and trace[key] != value:
                raise ValueError(f"the trace states {key} {trace[key]}, the plan of its layers gives {value}")
    return cfg


def run_trace(trace: dict[str, Any], policy: str = "vllm", engine: str = "jax",
              window_aware_eviction: bool = False) -> dict[str, Any]:
    """Replay every event of ``trace``; returns the result object of trace-format section 3.

    ``engine``: ``jax`` (the jitted allocator, ``KVCacheManager``) or ``model``
    (the plain-Python statement of the rules, ``PyAllocator``).
    ``window_aware_eviction``: our eviction order (``KVCacheManager``; jax engine only).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if window_aware_eviction and engine != "jax":
        raise ValueError("window-aware eviction is implemented by the jax engine only")
    cfg = trace_config(trace, policy)
    if engine == "jax":
        # At most as many request slots as requests alive at once (each slot count compiles anew).
        live = peak = 0
        for evs in trace["steps"]:
            for ev in evs:
                live += {"add": 1, "free": -1}.get(ev.get("op"), 0)
                peak = max(peak, live)
        alloc = KVCacheManager(cfg, trace["max_model_len"], max_requests=max(1, peak),
                               window_aware_eviction=window_aware_eviction)
    else:
        alloc = PyAllocator(cfg, trace["max_model_len"])
    events = []
    for step, evs in enumerate(trace["steps"]):
        alloc.new_step()
        for ev in evs:
            op = ev.get("op")
            if op not in OPS:
                raise ValueError(f"step {step}: unknown op {op!r}")
            res: dict[str, Any] = {"step": step, "op": op}
            if "id" in ev:
                res["id"] = ev["id"]
            try:
                if op == "add":
                    alloc.add(ev["id"], ev["prompt"])
                    res["prompt_len"] = len(ev["prompt"])
                    res["num_block_hashes"] = len(ev["prompt"]) // cfg.hash_block_size
                elif op == "schedule":
                    out = ev.get("output_tokens") or [None]
                    res.update(alloc.schedule(ev["id"], ev.get("num_tokens", "all"), out[0]))
                elif op == "free":
                    alloc.free(ev["id"])
                    res["ok"] = True
                elif op == "preempt":
                    alloc.preempt(ev["id"])
                    res["ok"] = True
                else:
                    res["ok"] = alloc.reset_prefix_cache()
            except KeyError as e:
                raise ValueError(f"step {step} {op}: unknown request or missing field {e.args[0]!r}") from None
            res["num_free_blocks"] = alloc.num_free_blocks
            events.append(res)
    return {
        "workload_name": trace.get("name"),
        "engine": f"hkv-jax {engine}",
        "policy": policy,
        "kv_cache_config": {
            "num_blocks": cfg.num_blocks,
            "bytes_per_block": cfg.bytes_per_block,
            "groups": [
                {"group_id": g.group_id, "layer_names": list(g.all_layer_names), "block_size": g.block_size,
                 "spec_type": g.spec.kind}
                for g in cfg.groups
            ],
        },
        "initial_num_free_blocks": cfg.num_blocks - 1,
        "events": events,
    }


def replay_file(path: str, out: str | None, policy: str = "vllm", engine: str = "jax",
                window_aware_eviction: bool = False) -> dict[str, Any]:
    """Replay the trace at ``path`` (``run_trace``' options); write the result to ``out`` when given."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    result = run_trace(trace, policy, engine, window_aware_eviction)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result
