"""The multiple-choice results in results.md (accuracy and %Evict per task, policy, budget
and mode), accuracy against eviction per task, and the eviction-pattern figure of one
example (``kvgate eval pattern``, and ``mc`` / ``matched`` for a thresholded gate)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.columns import column_table
from kvgate.eval.command import Report
from kvgate.eval.errors import EvalError
from kvgate.eval.plots import draw_series, pyplot, save_figure

COLUMNS = [("task", "task"), ("policy", "policy"), ("budget", "budget"), ("mode", "mode"),
           ("n", "n"), ("acc", "acc %"), ("acc_norm", "acc_norm %"), ("evict_pct", "%Evict"),
           ("evict_pct_tokens", "%Evict (token-weighted)")]


def mc_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return column_table("mc", COLUMNS, rows)


def plot_accuracy_vs_eviction(results: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Accuracy against %Evict, one panel per task (plus the task mean), one series per
    policy (points joined in eviction order). None when there is nothing to plot."""
    mc = [r for r in results if r.get("kind") == "mc" and r.get("acc") is not None]
    if not mc:
        return None
    plt = pyplot()
    tasks = sorted({r["task"] for r in mc})
    panels = tasks + (["mean"] if len(tasks) > 1 else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, task in zip(axes[0], panels):
        if task == "mean":
            groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
            for r in mc:
                groups[(r["policy"], r["budget"], r["mode"])].append(r)
            rows = [{"policy": p, "acc": sum(x["acc"] for x in g) / len(g),
                     "evict_pct": sum(x["evict_pct"] for x in g) / len(g)}
                    for (p, _, _), g in groups.items() if len(g) == len(tasks)]
        else:
            rows = [r for r in mc if r["task"] == task]
        draw_series(ax, rows, "acc", task, "accuracy %")
    return save_figure(plt, fig, axes, path)


def mc_plots(results: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    path = plot_accuracy_vs_eviction(results, Path(out_dir) / "accuracy_vs_eviction.png")
    return [] if path is None else [path]


def plot_eviction_pattern(keep: Any, path: str | Path, title: str = "",
                          tokens: Sequence[str] | None = None) -> Path:
    """Which (layer, token) entries a policy kept, one panel per KV head (like Figure 1 of
    the Attention-Gate paper). ``keep``: [L, H_kv, n] bool (tensor or nested lists)."""
    import numpy as np

    keep = np.asarray(keep.cpu() if hasattr(keep, "cpu") else keep, dtype=float)
    if keep.ndim != 3:
        raise EvalError(f"eviction pattern must be [layers, kv_heads, tokens], got {keep.shape}")
    plt = pyplot()
    layers, heads, n = keep.shape
    fig, axes = plt.subplots(heads, 1, figsize=(min(18, 2 + 0.12 * n), 0.6 + 0.25 * layers * heads
                                                 + 0.4 * heads), squeeze=False)
    for h in range(heads):
        ax = axes[h][0]
        ax.imshow(keep[:, h, :], cmap="Greys_r", vmin=0, vmax=1, aspect="auto",
                  interpolation="nearest")
        ax.set_ylabel(f"head {h}\nlayer")
        if tokens is not None and len(tokens) == n and n <= 120:
            labels = ["".join(c if c.isprintable() else "?" for c in str(t)) for t in tokens]
            ax.set_xticks(range(n), labels, rotation=90, fontsize=5)
        else:
            ax.set_xlabel("token")
    kept = keep.mean() * 100
    fig.suptitle(f"{title} kept {kept:.1f}% (white = kept, black = evicted)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


REPORT = Report("mc", mc_markdown, mc_plots)
