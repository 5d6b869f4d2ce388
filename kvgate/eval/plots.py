"""The plot pieces every results module draws with (matplotlib, Agg backend: no display
needed): a series per policy against %Evict, a grid of such panels, a length x depth heatmap."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_series(ax: Any, rows: Sequence[dict[str, Any]], metric: str, title: str,
                 ylabel: str) -> None:
    policies = sorted({r["policy"] for r in rows})
    if len(policies) > 10:  # the default cycle has 10 colours: past it two curves would share one
        from matplotlib import colormaps

        # paired shades, and past 20 curves a second set of 20
        ax.set_prop_cycle(color=colormaps["tab20"].colors + colormaps["tab20b"].colors)
    for policy in policies:
        pts = sorted((r["evict_pct"], r[metric]) for r in rows if r["policy"] == policy)
        if policy == "full":  # the no-eviction reference: a line, so 0% does not set the range
            ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=0.8, label=policy)
        else:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_title(title)
    ax.set_xlabel("%Evict")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


LONG_LEGEND = 8  # more series than this and the legend goes beside the plot, not over it


def save_figure(plt: Any, fig: Any, axes: Any, path: str | Path) -> Path:
    ax = axes[0][-1]
    if len(ax.get_legend_handles_labels()[1]) > LONG_LEGEND:
        width, height = fig.get_size_inches()
        fig.set_size_inches(width + 3.0, height)  # room for the legend, the panels keep theirs
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def depth_heatmap(grid: list[list[float]], lengths: list[int], depths: list[float], title: str,
                  label: str, path: Path) -> Path:
    """A context length x needle depth heatmap of 0-100 scores (NaN: not run), saved to path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(depths), 1.2 + 0.5 * len(lengths)))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth %")
    ax.set_ylabel("context tokens")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def panel_figure(panels: Sequence[tuple[str, Sequence[dict[str, Any]]]], metric: str,
                 ylabel: str, path: str | Path) -> Path:
    """``(title, rows)`` panels, five to a line, each a :func:`draw_series` of ``metric``;
    the legend on the last panel."""
    cols = min(5, len(panels))
    nrows = math.ceil(len(panels) / cols)
    plt = pyplot()
    fig, axes = plt.subplots(nrows, cols, figsize=(4.0 * cols, 3.4 * nrows), squeeze=False)
    for i, (title, rows) in enumerate(panels):
        draw_series(axes[i // cols][i % cols], rows, metric, title, ylabel)
    for j in range(len(panels), nrows * cols):
        axes[j // cols][j % cols].axis("off")
    last = (len(panels) - 1) // cols, (len(panels) - 1) % cols
    out = save_figure(plt, fig, [[axes[last[0]][last[1]]]], path)
    plt.close("all")
    return out
