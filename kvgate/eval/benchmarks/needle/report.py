"""The needle's results in results.md (accuracy per length and depth, policy, budget and mode)
and one length x depth heatmap per (policy, budget, mode)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.columns import column_table
from kvgate.eval.command import Report
from kvgate.eval.plots import depth_heatmap

COLUMNS = [("task", "length|depth"), ("policy", "policy"), ("budget", "budget"),
           ("mode", "mode"), ("n", "n"), ("acc", "acc %"), ("evict_pct", "%Evict")]


def needle_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return column_table("needle", COLUMNS, rows)


def plot_needle_heatmaps(results: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One heatmap (context length x needle depth -> accuracy) per (policy, budget, mode)."""
    needle = [r for r in results if r.get("kind") == "needle" and r.get("acc") is not None]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in needle:
        groups[(r["policy"], r["budget"], r["mode"])].append(r)
    if not groups:
        return []
    paths = []
    for (policy, budget, mode), rows in sorted(groups.items()):
        lengths = sorted({int(r["length"]) for r in rows})
        depths = sorted({float(r["depth"]) for r in rows})
        grid = [[math.nan] * len(depths) for _ in lengths]
        for r in rows:
            grid[lengths.index(int(r["length"]))][depths.index(float(r["depth"]))] = r["acc"]
        path = Path(out_dir) / f"needle_{policy}_{budget}_{mode}.png".replace("/", "_")
        paths.append(depth_heatmap(grid, lengths, depths, f"{policy} ({budget}, {mode})",
                                   "accuracy %", path))
    return paths


REPORT = Report("needle", needle_markdown, plot_needle_heatmaps)
