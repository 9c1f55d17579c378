"""`python -m dwconv bench --plot FILE.png`: speedup per layer and achieved bandwidth against the
copy ceiling, from the benchmark's rows (needs matplotlib, imported only here)."""

from __future__ import annotations

from typing import Dict, List

# (dwconv path, PyTorch path it is compared with, legend)
COMPARISONS = [("dwconv", "eager", "NCHW: dwconv / eager"),
               ("dwconv_cl", "cudnn_cl", "channels_last: dwconv / cuDNN")]


def speedups(rows: List[Dict], pass_name: str) -> Dict[str, Dict[str, float]]:
    """{legend: {layer: PyTorch ms / dwconv ms}} for one pass ("forward" or "fwd+bwd")."""
    ms = {(r["layer"], r["path"]): r["ms"] for r in rows if r["pass"] == pass_name}
    layers = list(dict.fromkeys(r["layer"] for r in rows if r["pass"] == pass_name))
    return {legend: {layer: ms[(layer, theirs)] / ms[(layer, ours)] for layer in layers
                     if (layer, ours) in ms and (layer, theirs) in ms}
            for ours, theirs, legend in COMPARISONS}


def _legend_above(ax, columns: int, **kwargs) -> None:
    """The legend in a row over the panel: inside it would hide the tallest bars and the points
    nearest the copy line (kb84's, at the right end)."""
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=columns, frameon=False, **kwargs)


def plot_rows(rows: List[Dict], copy_gbps: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [p for p in ("forward", "fwd+bwd") if any(r["pass"] == p for r in rows)]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(len(passes) + 1, 1, figsize=(max(10, 0.28 * len(layers)), 4.5 * (len(passes) + 1)))
    positions = range(len(layers))
    for ax, pass_name in zip(axes, passes):
        for k, (legend, values) in enumerate(speedups(rows, pass_name).items()):
            ax.bar([i + 0.4 * k for i in positions], [values.get(layer, 0.0) for layer in layers], 0.4, label=legend)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"{pass_name}: speedup (x)")
        _legend_above(ax, len(COMPARISONS))
        ax.set_xticks([])
    ax = axes[-1]
    for path_name, marker in (("dwconv", "o"), ("dwconv_cl", "s")):
        for pass_name in passes:
            gbps = {r["layer"]: r["gbps"] for r in rows if r["path"] == path_name and r["pass"] == pass_name}
            if gbps:
                ax.plot([i for i, layer in enumerate(layers) if layer in gbps], [gbps[layer] for layer in layers
                        if layer in gbps], marker, label=f"{path_name} {pass_name}", markersize=4)
    ax.axhline(copy_gbps, color="red", linestyle="--", label=f"device copy {copy_gbps:.0f} GB/s")
    ax.set_ylabel("GB/s (bytes a pass must move)")
    ax.set_xticks(list(positions))
    ax.set_xticklabels(layers, rotation=90, fontsize=6)
    _legend_above(ax, 3, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
