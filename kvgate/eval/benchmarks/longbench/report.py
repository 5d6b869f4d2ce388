"""LongBench results in results.md and a plot (the shared writers of
:mod:`kvgate.eval.columns`): the score per task, the average over tasks (LongBench's headline
number; Bai et al., arXiv:2308.14508) with a 95% interval, %Evict, seconds per example and their
ratio to the full cache's, LongBench-E's scores by length, and score against %Evict per task."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.columns import fmt, task_tables
from kvgate.eval.command import Report
from kvgate.eval.intervals import share_interval

Row = dict[str, Any]
BUCKETS = ("0-4k", "4-8k", "8k+")


def _longbench(results: Sequence[Row]) -> list[Row]:
    return [r for r in results if r.get("kind") == "longbench" and r.get("acc") is not None]


def averages(results: Sequence[Row]) -> list[Row]:
    """One row per (policy, budget, mode): the mean of its task scores, the 95% interval of that
    mean (:func:`kvgate.eval.intervals.share_interval`, never of zero width at 0 or 100%),
    %Evict, seconds per example and their ratio to the full cache's over the same tasks and
    mode (where ``full`` ran them); with ``--score teacher``
    the mean greedy-exact score and agreement, with ``--paired`` the paired difference of the
    average (tasks matched one to one)."""
    from kvgate.eval.columns import mean_of
    from kvgate.eval.paired import average_paired  # here: the store it reads loads torch

    groups: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for r in _longbench(results):
        groups[(r["policy"], r["budget"], r["mode"])].append(r)
    out = []
    for (policy, budget, mode), rows in sorted(groups.items()):
        scores = [[float(e["score"]) for e in r.get("examples", {}).values()] for r in rows]
        lo, hi = share_interval(scores)
        out.append({"policy": policy, "budget": budget, "mode": mode, "tasks": len(rows),
                    "task_set": frozenset(r["task"] for r in rows),
                    "n": sum(r["n"] for r in rows),
                    "acc": sum(r["acc"] for r in rows) / len(rows), "ci_low": lo, "ci_high": hi,
                    "evict_pct": sum(r["evict_pct"] for r in rows) / len(rows),
                    "sec_per_example": sum(r["sec_per_example"] for r in rows) / len(rows),
                    **mean_of(rows, "teacher_acc"), **mean_of(rows, "agree_pct")})
        paired = average_paired(rows, groups, (policy, budget, mode), 0, 1, "task")
        if paired is not None:
            out[-1]["paired"] = paired
    full = {(a["mode"], a["task_set"]): a["sec_per_example"] for a in out
            if a["policy"] == "full"}
    for a in out:
        ref = full.get((a["mode"], a["task_set"]))
        a["x_full"] = a["sec_per_example"] / ref if ref else math.nan
    return out


def longbench_markdown(results: Sequence[Row]) -> str:
    """The per-task table, the average over tasks and, for LongBench-E tasks, the scores by
    length ('' when there are no LongBench results)."""
    rows = sorted(_longbench(results), key=lambda r: (r["task"], r["policy"], r["budget"],
                                                      r["mode"]))
    if not rows:
        return ""
    setting = [("policy", "policy"), ("budget", "budget"), ("mode", "mode")]
    lines = task_tables("longbench", "score", rows, [("task", "task"), ("metric", "metric"),
                                                     *setting],
                        averages(results), [*setting, ("tasks", "tasks")], "tasks")
    by_length = [r for r in rows if f"acc_{BUCKETS[0]}" in r]
    if by_length:
        lines += ["", "### longbench-e (score by length)", "",
                  "| task | policy | budget | mode | " + " | ".join(BUCKETS) + " |",
                  "|" + "---|" * (4 + len(BUCKETS))]
        for r in by_length:
            by_bucket = " | ".join(fmt(r.get(f"acc_{b}")) for b in BUCKETS)
            lines.append(f"| {r['task']} | {r['policy']} | {r['budget']} | {r['mode']} | "
                         f"{by_bucket} |")
    return "\n".join(lines)


def plot_longbench_accuracy(results: Sequence[Row], out_dir: str | Path) -> list[Path]:
    """Per mode: score against %Evict, one panel per task (and the average over the tasks of
    the settings that ran them all), one series per policy."""
    from kvgate.eval.plots import panel_figure

    rows = _longbench(results)
    paths = []
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        tasks = sorted({r["task"] for r in mine})
        panels = [(t, [r for r in mine if r["task"] == t]) for t in tasks]
        if len(tasks) > 1:
            panels.append(("average", [a for a in averages(mine) if a["tasks"] == len(tasks)]))
        paths.append(panel_figure(panels, "acc", "score",
                                  Path(out_dir) / f"longbench_accuracy_{mode}.png"))
    return paths


REPORT = Report("longbench", longbench_markdown, plot_longbench_accuracy)
