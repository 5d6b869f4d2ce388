"""RULER results: tables (per task family and averaged, with 95% intervals and seconds per
example) and plots (accuracy vs eviction per family, length x depth heatmaps of the needle
families), drawn by the shared writers of :mod:`kvgate.eval.columns`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.columns import mean_of, task_tables
from kvgate.eval.command import Report
from kvgate.eval.intervals import share_interval

Row = dict[str, Any]


def _ruler(results: Sequence[Row]) -> list[Row]:
    return [r for r in results if r.get("kind") == "ruler" and r.get("acc") is not None]


def _group(rows: Sequence[Row]) -> dict[tuple[int, str, str, str], list[Row]]:
    """(length, policy, budget, mode) -> that setting's rows, one per task family."""
    groups: dict[tuple[int, str, str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(int(r["length"]), r["policy"], r["budget"], r["mode"])].append(r)
    return groups


def averages(results: Sequence[Row]) -> list[Row]:
    """One row per (length, policy, budget, mode): the mean of the family scores, its 95%
    interval (Wilson's at an effective size, :func:`kvgate.eval.intervals.share_interval`: never
    of zero width at 0 or 100%), %Evict, seconds per example and their ratio to the full
    cache's at the same length and mode (where ``full`` ran)."""
    from kvgate.eval.paired import average_paired  # here: the store it reads loads torch

    groups = _group(_ruler(results))
    out = []
    for (length, policy, budget, mode), rows in sorted(groups.items()):
        scores = [[float(e["score"]) for e in r.get("examples", {}).values()] for r in rows]
        lo, hi = share_interval(scores)
        secs = sum(r["sec_per_example"] for r in rows) / len(rows)
        out.append({"length": length, "policy": policy, "budget": budget, "mode": mode,
                    "families": len(rows), "n": sum(r["n"] for r in rows),
                    "acc": sum(r["acc"] for r in rows) / len(rows), "ci_low": lo, "ci_high": hi,
                    "evict_pct": sum(r["evict_pct"] for r in rows) / len(rows),
                    "sec_per_example": secs, **mean_of(rows, "teacher_acc"),
                    **mean_of(rows, "agree_pct")})
        paired = average_paired(rows, groups, (length, policy, budget, mode), 1, 2, "family")
        if paired is not None:
            out[-1]["paired"] = paired
    full = {(r["length"], r["mode"], r["families"]): r["sec_per_example"] for r in out
            if r["policy"] == "full"}
    for r in out:
        ref = full.get((r["length"], r["mode"], r["families"]))
        r["x_full"] = r["sec_per_example"] / ref if ref else math.nan
    return out


def ruler_markdown(results: Sequence[Row]) -> str:
    """The per-family table and the averaged one ('' when there are no RULER results)."""
    rows = _ruler(results)
    if not rows:
        return ""
    ordered = sorted(rows, key=lambda r: (r["family"], int(r["length"]), r["policy"],
                                          r["budget"], r["mode"]))
    setting = [("policy", "policy"), ("budget", "budget"), ("mode", "mode")]
    return "\n".join(task_tables(
        "ruler", "score %", ordered, [("task", "family"), ("length", "length"), *setting],
        averages(results), [("length", "length"), *setting, ("families", "families")],
        "task families"))


def plot_ruler_accuracy(results: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """Per context length and mode: score against %Evict, one panel per task family (and the
    average), one series per policy."""
    from kvgate.eval.plots import panel_figure

    rows = _ruler(results)
    paths = []
    for length, mode in sorted({(int(r["length"]), r["mode"]) for r in rows}):
        mine = [r for r in rows if int(r["length"]) == length and r["mode"] == mode]
        families = sorted({r["family"] for r in mine})
        panels = [(f, [r for r in mine if r["family"] == f]) for f in families]
        if len(families) > 1:
            panels.append(("average", [a for a in averages(mine)
                                       if a["families"] == len(families)]))
        paths.append(panel_figure(panels, "acc", "score %",
                                  Path(out_dir) / f"ruler_accuracy_{length}_{mode}.png"))
    return paths


def plot_ruler_heatmaps(results: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """One heatmap (context length x needle depth -> score, over the needle families' examples)
    per (policy, budget, mode)."""
    from kvgate.eval.benchmarks.ruler.run import NEEDLE_FAMILIES
    from kvgate.eval.plots import depth_heatmap

    rows = [r for r in _ruler(results) if r["family"] in NEEDLE_FAMILIES]
    cells: dict[tuple[str, str, str], dict[tuple[int, float], list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        for e in r.get("examples", {}).values():
            if e.get("depth") is not None:
                cells[(r["policy"], r["budget"], r["mode"])][(int(r["length"]),
                                                              float(e["depth"]))].append(
                    float(e["score"]))
    if not cells:
        return []
    paths = []
    for (policy, budget, mode), grid_cells in sorted(cells.items()):
        lengths = sorted({k[0] for k in grid_cells})
        depths = sorted({k[1] for k in grid_cells})
        grid = [[math.nan] * len(depths) for _ in lengths]
        for (length, depth), scores in grid_cells.items():
            grid[lengths.index(length)][depths.index(depth)] = sum(scores) / len(scores)
        path = Path(out_dir) / f"ruler_niah_{policy}_{budget}_{mode}.png".replace("/", "_")
        paths.append(depth_heatmap(grid, lengths, depths,
                                   f"ruler niah: {policy} ({budget}, {mode})", "score %", path))
    return paths


def ruler_plots(results: Sequence[Row], out_dir: Path) -> list[Path]:
    return plot_ruler_accuracy(results, out_dir) + plot_ruler_heatmaps(results, out_dir)


REPORT = Report("ruler", ruler_markdown, ruler_plots)
