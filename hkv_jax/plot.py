"""``hkv plan --plot``: the memory layout of a plan and a capacity chart (needs matplotlib)."""

from __future__ import annotations

from hkv_jax.planner import KVCacheConfig

# Colours by layer kind (groups of one kind share one; the x axis names each group).
_KIND_COLOURS = {"full": "tab:blue", "sliding_window": "tab:orange", "chunked_local": "tab:green",
                 "mamba": "tab:purple"}


def slot_fill(cfg: KVCacheConfig) -> list[list[list[float]]]:
    """Per group, per shared tensor (layer slot): the fraction of the slot's page each of its layers holds
    (none for an empty slot; one layer below 1 where a smaller page or a Mamba state is padded to the
    unified page; several where layers share the slot: ``layers_per_slot``)."""
    out = []
    for g in cfg.groups:
        used, r = g.used_bytes_per_slot() / cfg.page_size_bytes, g.layers_per_slot
        out.append([[used] * len(g.layer_names[row * r:(row + 1) * r]) for row in range(cfg.group_size)])
    return out


def plot_plan(
    path: str, model: str, chosen: KVCacheConfig, others: dict[str, KVCacheConfig], max_model_len: int
) -> None:
    """Write a PNG: one block of every group (its layer slots, data coloured by kind, padding hatched), and
    the max concurrency per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hkv-jax[plot]'") from None

    cfg = chosen
    fill = slot_fill(cfg)
    n = len(cfg.groups)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(8, 2 + 0.35 * n), 4 + 0.22 * cfg.group_size),
                                 gridspec_kw={"height_ratios": [3, 1.3]})
    for col, g in enumerate(cfg.groups):
        colour = _KIND_COLOURS.get(g.spec.kind, "tab:gray")
        for row, layers in enumerate(fill[col]):
            x = 0.0
            for used in layers:  # one rectangle per layer of the slot
                ax.add_patch(Rectangle((col + x, row), used, 1, facecolor=colour, edgecolor="white"))
                x += used
            if x < 1:  # the rest of the slot is padding
                ax.add_patch(Rectangle((col + x, row), 1 - x, 1, facecolor="white", hatch="//", edgecolor="0.6"))
    ax.set_xlim(0, n)
    ax.set_ylim(cfg.group_size, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"g{g.group_id} bs={g.block_size}" for g in cfg.groups],
                  rotation=90, fontsize=7)
    ax.set_xlabel("KV cache group: one block of each (bs = its tokens per block)")
    ax.set_ylabel("shared tensor (layer slot)")
    step = max(1, cfg.group_size // 16)
    ax.set_yticks([r + 0.5 for r in range(0, cfg.group_size, step)], [str(r) for r in range(0, cfg.group_size, step)])
    ax.set_title(
        f"{model}: policy {cfg.policy}, {n} groups x {cfg.group_size} slots of {cfg.page_size_bytes} B; "
        f"padding {100 * cfg.padding_fraction:.1f}% (hatched)", fontsize=9
    )
    kinds = dict.fromkeys(g.spec.kind for g in cfg.groups)
    handles = [Patch(color=_KIND_COLOURS.get(k, "tab:gray"), label=k) for k in kinds]
    handles.append(Patch(facecolor="white", hatch="//", edgecolor="0.6", label="padding"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)

    names = list(others)
    conc = [others[p].max_concurrent_requests(max_model_len) for p in names]
    bars = bx.barh(names, conc, color=["tab:blue" if p == cfg.policy else "tab:gray" for p in names])
    bx.bar_label(
        bars, [f"{c} req, pad {100 * others[p].padding_fraction:.1f}%" for c, p in zip(conc, names)], fontsize=8
    )
    bx.set_xlabel(f"max concurrent requests at {max_model_len} tokens, {others[names[0]].total_bytes / 2**30:.1f} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
