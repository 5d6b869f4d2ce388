"""Perplexity under eviction in results.md (per corpus, policy, budget and mode) and
perplexity against eviction per corpus."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.columns import column_table
from kvgate.eval.command import Report
from kvgate.eval.plots import draw_series, pyplot, save_figure

COLUMNS = [("task", "corpus"), ("policy", "policy"), ("budget", "budget"), ("mode", "mode"),
           ("n", "n"), ("tokens", "scored tokens"), ("ppl", "ppl"), ("evict_pct", "%Evict")]


def ppl_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return column_table("ppl", COLUMNS, rows)


def plot_ppl_vs_eviction(results: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Perplexity against %Evict (a log axis where it spans more than 3x), one panel per
    text and context, one series per policy (points joined in eviction order: a policy run at
    several keep thresholds or budgets becomes a curve). None when there is nothing to plot."""
    ppl = [r for r in results if r.get("kind") == "ppl" and r.get("ppl") is not None]
    if not ppl:
        return None
    plt = pyplot()
    tasks = sorted({r["task"] for r in ppl})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in ppl if r["task"] == task]
        draw_series(ax, rows, "ppl", task, "perplexity")
        values = [r["ppl"] for r in rows]
        if max(values) > 3 * min(values):  # a log axis only where one is needed to see both ends
            ax.set_yscale("log")
    return save_figure(plt, fig, axes, path)


def ppl_plots(results: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    path = plot_ppl_vs_eviction(results, Path(out_dir) / "ppl_vs_eviction.png")
    return [] if path is None else [path]


REPORT = Report("ppl", ppl_markdown, ppl_plots)
