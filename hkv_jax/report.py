"""Human-readable and JSON reports of a plan (what ``hkv plan`` prints)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hkv_jax.cache import CacheLayout
from hkv_jax.planner import POLICIES, KVCacheConfig, plan
from hkv_jax.spec import LayerSpec

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """Parse ``"80GiB"``, ``"1.5TB"``, ``"4096"`` into bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read {text!r} as a memory size (examples: 80GiB, 512MiB, 1e9)")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a memory size (examples: 80GiB, 512MiB, 1e9)") from None
    if value <= 0:
        raise ValueError(f"memory must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. ``80.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def cache_dtypes(layers: tuple[LayerSpec, ...]) -> dict[str, list[str]]:
    """The dtypes the cache stores: ``{"kv": [...]}`` of the attention layers' K/V, and ``"states"`` of the
    Mamba states (empty without such layers)."""
    return {"kv": sorted({l.dtype for l in layers if hasattr(l, "dtype")}),
            "states": sorted({d for l in layers for d in getattr(l, "dtypes", ())})}


def layer_summary(layers: tuple[LayerSpec, ...]) -> str:
    """``62 layers: 52 sliding_window, 10 full; KV bfloat16`` (and the Mamba states' dtype, if any)."""
    kinds = Counter(l.kind for l in layers)
    parts = ", ".join(f"{n} {k}" for k, n in kinds.items())
    dtypes = cache_dtypes(layers)
    stored = "; ".join(f"{what} {'/'.join(dtypes[key])}" for what, key in (("KV", "kv"), ("Mamba states", "states"))
                       if dtypes[key])
    return f"{len(layers)} layers: {parts}; {stored}"


def _names(names: tuple[str, ...], limit: int = 4) -> str:
    short = [n.removeprefix("model.layers.") for n in names]
    return ",".join(short[:limit]) + (f",… (+{len(short) - limit})" if len(short) > limit else "")


def tensor_parallel(config: KVCacheConfig, tp: int) -> dict[str, int]:
    """What one of ``tp`` devices holds of ``config``'s pool when the ``model`` axis has ``tp`` devices:
    layer slots split by KV head (the others replicated), bytes per block id and in all."""
    layout = CacheLayout.from_config(config, model_shards=tp)
    per_device = layout.bytes_per_device()
    return {"devices": tp, "split_layer_slots": sum(s > 1 for s in layout.shards), "layer_slots": layout.num_tensors,
            "bytes_per_block_per_device": per_device // layout.num_blocks, "bytes_per_device": per_device}


def compare_policies(layers, *, block_size: int, memory_bytes: int | None, num_blocks: int | None,
                     tp: int = 1) -> dict[str, KVCacheConfig]:
    """The plan of ``layers`` under every policy, same budget; with ``tp`` devices on the ``model`` axis,
    ``memory_bytes`` is each device's budget (split layer slots cost a ``1 / tp`` part of each page)."""
    out = {}
    for p in POLICIES:
        if tp > 1 and memory_bytes is not None:
            per_block = tensor_parallel(plan(layers, block_size=block_size, policy=p, num_blocks=2), tp)[
                "bytes_per_block_per_device"]
            if memory_bytes // per_block < 2:
                raise ValueError(f"{format_bytes(memory_bytes)} per device holds less than 2 blocks "
                                 f"({format_bytes(per_block)} each under policy {p})")
            out[p] = plan(layers, block_size=block_size, policy=p, num_blocks=memory_bytes // per_block)
        else:
            out[p] = plan(layers, block_size=block_size, policy=p, memory_bytes=memory_bytes, num_blocks=num_blocks)
    return out


def _runs(rows) -> list[tuple[list[int], str]]:
    """``(group ids, key)`` per run of consecutive ``(group id, key, joins)`` rows with one key (a row whose
    ``joins`` is False starts a run of its own)."""
    runs: list[tuple[list[int], str]] = []
    for gid, key, joins in rows:
        if runs and runs[-1][1] == key and joins:
            runs[-1][0].append(gid)
        else:
            runs.append(([gid], key))
    return runs


def _label(ids: list[int]) -> str:
    """A run's group ids as ``3`` or ``0-25``."""
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def render_table(model: str, layers, chosen: KVCacheConfig, others: dict[str, KVCacheConfig], max_model_len: int,
                 tp: int = 1) -> str:
    """The text report: the chosen plan's groups, then every policy side by side (per device with ``tp``)."""
    c = chosen
    out = [
        f"{model}  ({layer_summary(layers)})",
        f"policy {c.policy}: {len(c.groups)} KV cache groups x {c.group_size} layer slots, "
        f"page {format_bytes(c.page_size_bytes)}, block {format_bytes(c.bytes_per_block)}, "
        f"{c.num_blocks} blocks (null block included) = {format_bytes(c.total_bytes)}",
    ]
    if c.hash_block_size != c.scheduler_block_size:
        out.append(f"groups of different block sizes: a prefix hash every {c.hash_block_size} tokens (gcd), "
                   f"cache hits in multiples of {c.scheduler_block_size} tokens (lcm)")
    if tp > 1:
        t = tensor_parallel(c, tp)
        out.append(f"tensor parallel over {tp} devices: {t['split_layer_slots']} of {t['layer_slots']} layer slots "
                   f"split by KV head (the rest replicated); per device a block is "
                   f"{format_bytes(t['bytes_per_block_per_device'])}, the pool {format_bytes(t['bytes_per_device'])}")
    out += [
        "",
        f"{'group':>5}  {'type':<15} {'layers':>6} {'block':>6} {'span':>4} {'slot':>4} {'pad':>4} {'pad %':>6}"
        "  layers",
    ]
    # Consecutive groups that differ only in their layers share one row.
    rows = _runs((g.group_id, f"{g.spec.kind:<15} {len(g.layer_names):>6} {g.block_size:>6} {g.blocks_per_state:>4} "
                  f"{g.layers_per_slot:>4} {c.group_padding_layers(g):>4} {100 * c.group_padding_fraction(g):>5.1f}%",
                  not g.shared_layer_names) for g in c.groups)
    for ids, key in rows:
        g = c.groups[ids[0]]
        extra = f" +shared {_names(g.shared_layer_names)}" if g.shared_layer_names else ""
        more = f" (+{len(ids) - 1} groups like it)" if len(ids) > 1 else ""
        out.append(f"{_label(ids):>5}  {key}  {_names(g.layer_names)}{extra}{more}")
    out += [
        "",
        f"policies compared (same memory{' per device' if tp > 1 else ''}; max concurrent requests at "
        f"max-model-len {max_model_len}):",
        f"{'policy':<10} {'groups':>6} {'blocks of':>9} {'hit unit':>8} {'pad layers':>10} {'pad %':>6} "
        f"{'blocks':>10} {'capacity tok':>13} {'blocks/req':>10} {'max conc':>9}",
    ]
    for name, p in others.items():
        mark = " <" if name == c.policy else ""
        out.append(
            f"{name:<10} {len(p.groups):>6} {'/'.join(map(str, sorted({g.block_size for g in p.groups}))):>9} "
            f"{p.scheduler_block_size:>8} {p.padding_layers:>10} {100 * p.padding_fraction:>5.1f}% "
            f"{p.num_blocks:>10} {p.capacity_tokens:>13} {p.blocks_per_request(max_model_len):>10} "
            f"{p.max_concurrent_requests(max_model_len):>9}{mark}"
        )
    out.append("(capacity tok: vLLM's figure, usable blocks / groups x smallest block size; blocks of: tokens per "
               "block; hit unit: prefix hits are multiples of it; span: blocks per Mamba state; slot: layers per "
               "page slot)")
    return "\n".join(out)


def plan_json(model: str, layers, chosen: KVCacheConfig, others: dict[str, KVCacheConfig], max_model_len: int,
              tp: int = 1) -> dict[str, Any]:
    """The JSON report: the chosen plan in full, a summary of every policy, and what one device holds."""
    return {
        "tensor_parallel": tensor_parallel(chosen, tp),
        "model": model,
        "num_layers": len(layers),
        "layer_kinds": dict(Counter(l.kind for l in layers)),
        "kv_sharing_layers": sum(not l.owns_kv for l in layers),
        "cache_dtypes": cache_dtypes(layers),
        "plan": chosen.to_dict(max_model_len),
        "compare": {
            name: {k: v for k, v in p.to_dict(max_model_len).items() if k not in ("groups", "tensors", "kv_sharing")}
            for name, p in others.items()
        },
    }


def render_host(cap: dict) -> str:
    """The text lines of ``host_tier.capacity``: what a host tier of that size holds, per KV cache group."""
    out = ["", f"host tier {format_bytes(cap['host_bytes'])} ({cap['blocks']} blocks; hits on the host end on "
               f"multiples of {cap['unit_tokens']} tokens, or where a request's prompt or cached prefix ended): "
               f"{cap['tokens']:,} cached tokens, {cap['naive_tokens'] and cap['tokens'] / cap['naive_tokens']:.1f}x "
               f"the {cap['naive_tokens']:,} of a tier that keeps every group's block for every token",
           f"{'group':>5}  {'type':<15} {'host B/token':>12} {'naive B/token':>13}"]
    for ids, key in _runs((g["group"], f"{g['kind']:<15} {g['bytes_per_token']:>12.1f} "
                                       f"{g['naive_bytes_per_token']:>13.1f}", True) for g in cap["groups"]):
        out.append(f"{_label(ids):>5}  {key}")
    out.append(f"{'all':>5}  {'':<15} {cap['bytes_per_token']:>12.1f} {cap['naive_bytes_per_token']:>13.1f}")
    return "\n".join(out)
