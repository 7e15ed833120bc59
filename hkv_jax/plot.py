"""``hkv plan --plot``: the memory layout of a plan and a capacity chart (needs matplotlib)."""

from __future__ import annotations

from hkv_jax.planner import KVCacheConfig

_MAX_COLUMNS = 40


def example_allocation(cfg: KVCacheConfig, num_tokens: int) -> list[int]:
    """Owner group of each block id for one request of ``num_tokens`` tokens, ids handed out group by group.

    Index 0 is the null block (owner -1). Capped at ``_MAX_COLUMNS`` blocks.
    """
    owners = [-1]
    for g in cfg.groups:
        owners += [g.group_id] * g.blocks_per_request(num_tokens)
    return owners[:_MAX_COLUMNS]


def plot_plan(
    path: str, model: str, chosen: KVCacheConfig, others: dict[str, KVCacheConfig], max_model_len: int
) -> None:
    """Write a PNG: shared tensors x blocks coloured by group, and max concurrency per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hkv-jax[plot]'") from None

    cfg = chosen
    # One request long enough to show every group's pattern without filling the figure.
    demo_tokens = min(max_model_len, 6 * max(g.block_size for g in cfg.groups))
    owners = example_allocation(cfg, demo_tokens)
    cmap = plt.get_cmap("tab20")
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, 4 + 0.28 * cfg.group_size), gridspec_kw={"height_ratios": [3, 1.3]})
    for col, gid in enumerate(owners):
        for row in range(cfg.group_size):
            if gid < 0:
                ax.add_patch(Rectangle((col, row), 1, 1, facecolor="0.85", edgecolor="white"))
                continue
            group = cfg.groups[gid]
            padded = row >= len(group.layer_names)
            ax.add_patch(Rectangle((col, row), 1, 1, facecolor="white" if padded else cmap(gid % 20),
                                   hatch="//" if padded else None, edgecolor="0.6" if padded else "white"))
    ax.set_xlim(0, len(owners))
    ax.set_ylim(cfg.group_size, 0)
    ax.set_xlabel(f"block id (one request of {demo_tokens} tokens; block 0 = null block, grey)")
    ax.set_ylabel("shared tensor")
    step = max(1, cfg.group_size // 16)
    ax.set_yticks([r + 0.5 for r in range(0, cfg.group_size, step)], [str(r) for r in range(0, cfg.group_size, step)])
    ax.set_title(
        f"{model}: policy {cfg.policy}, {len(cfg.groups)} groups x {cfg.group_size} tensors, "
        f"page {cfg.page_size_bytes} B, padding {100 * cfg.padding_fraction:.1f}% (hatched)"
    )
    shown = sorted({g for g in owners if g >= 0})
    handles = [
        Patch(color=cmap(g % 20), label=f"g{g} {cfg.groups[g].spec.kind} bs={cfg.groups[g].block_size}") for g in shown
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)

    names = list(others)
    conc = [others[n].max_concurrent_requests(max_model_len) for n in names]
    bars = bx.barh(names, conc, color=["tab:blue" if n == cfg.policy else "tab:gray" for n in names])
    bx.bar_label(
        bars, [f"{c} req, pad {100 * others[n].padding_fraction:.1f}%" for c, n in zip(conc, names)], fontsize=8
    )
    bx.set_xlabel(f"max concurrent requests at {max_model_len} tokens, {others[names[0]].total_bytes / 2**30:.1f} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
