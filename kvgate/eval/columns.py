"""The evaluation tables' writers, shared by every benchmark's report: a table of stored fields
(``column_table``: mc, needle, ppl), the per-task + average tables (``task_tables``: RULER,
LongBench), and their optional columns: the teacher score and its agreement with the
generated one (``--score``), the paired difference (``--paired``) and, for perplexity in cache
mode, what the cache holds after the continuation; a column is there only when a row has its
number."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]


def _number(key: str) -> Callable[[Row], str]:
    def cell(row: Row) -> str:
        value = row.get(key)
        return "-" if value is None or math.isnan(value) else f"{value:.1f}"

    return cell


def _paired(row: Row) -> str:
    p = row.get("paired")
    if not p or math.isnan(p["diff"]):
        return "-"
    return f"{p['diff']:+.1f} [{p['ci_low']:.1f}, {p['ci_high']:.1f}]"


def optional_columns(rows: Sequence[Row]) -> list[tuple[str, Callable[[Row], str]]]:
    """(header, cell) of each optional column some row fills."""
    out: list[tuple[str, Callable[[Row], str]]] = []
    if any("teacher_acc" in r for r in rows):
        out.append(("greedy-exact %", _number("teacher_acc")))
    if any("agree_pct" in r for r in rows):
        out.append(("agree %", _number("agree_pct")))
    if any("held_end_pct" in r for r in rows):  # ppl in cache mode: the cache at the end
        out.append(("held at end %", _number("held_end_pct")))
    names = sorted({r["paired"]["policy"] for r in rows if r.get("paired")})
    if names:
        out.append((f"vs {', '.join(names)} (paired)", _paired))
    return out


def header(columns: Sequence[tuple[str, Any]]) -> tuple[str, int]:
    """The header cells to append (`` a | b |``) and how many columns they add."""
    return "".join(f" {h} |" for h, _ in columns), len(columns)


def cells(columns: Sequence[tuple[str, Callable[[Row], str]]], row: Row) -> str:
    return "".join(f" {cell(row)} |" for _, cell in columns)


def mean_of(rows: Sequence[Row], key: str) -> dict[str, float]:
    """``{key: mean}`` over ``rows`` when every row has ``key``, else nothing."""
    if rows and all(key in r for r in rows):
        return {key: sum(float(r[key]) for r in rows) / len(rows)}
    return {}


def table(title: str, head: str, rows: Sequence[Row], line: Callable[[Row], str]) -> list[str]:
    """A question-answering table's markdown lines: ``### title``, the ``head`` row (``| a | b
    |``) and ``line(row)`` for each row, each followed by the optional columns some row fills."""
    columns = optional_columns(rows)
    extra, more = header(columns)
    width = head.count("|") - 1
    return [f"### {title}", "", head + extra, "|" + "---|" * (width + more)] + [
        line(r) + cells(columns, r) for r in rows]


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell's number, ``-`` where there is none (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def score_cells(r: Row) -> str:
    """``score | low-high | %Evict | s/example |`` of a question-answering row."""
    return (f"{fmt(r['acc'])} | {fmt(r['ci_low'])}-{fmt(r['ci_high'])} | "
            f"{fmt(r['evict_pct'])} | {fmt(r['sec_per_example'], 3)} |")


def cell(value: Any, digits: int = 2) -> str:
    """A plain table's cell: a float to ``digits`` places, ``-`` for none or NaN, else as is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def column_table(title: str, spec: Sequence[tuple[str, str]], rows: Sequence[Row]) -> str:
    """A table of one stored field per column (``spec``: (field, header) pairs), its rows in
    (task, policy, budget, mode) order ('' without rows): the mc, needle and ppl tables."""
    if not rows:
        return ""
    rows = sorted(rows, key=lambda r: (r["task"], r["policy"], r["budget"], r["mode"]))
    return "\n".join(table(title, "| " + " | ".join(h for _, h in spec) + " |", rows,
                           lambda r: "| " + " | ".join(cell(r.get(k)) for k, _ in spec)
                           + " |"))


def task_tables(title: str, score: str, rows: Sequence[Row], columns: Sequence[tuple[str, str]],
                averages: Sequence[Row], average_columns: Sequence[tuple[str, str]],
                unit: str) -> list[str]:
    """The per-task table and the one averaged over ``unit`` that RULER and LongBench draw
    alike: each row's own columns (``(header, field)`` pairs; ``-`` where a row lacks the
    field), then n, the ``score``, its 95% interval, %Evict and seconds per example; an
    average adds its seconds' ratio to the full cache's (``x_full``)."""
    def own(cols: Sequence[tuple[str, str]]) -> str:
        return "| " + " | ".join(h for h, _ in cols) + f" | n | {score} | 95% CI | %Evict | " \
            "s/example |"

    def line(r: Row, cols: Sequence[tuple[str, str]]) -> str:
        return "| " + " | ".join(str(r.get(f, "-")) for _, f in cols) + \
            f" | {r['n']} | {score_cells(r)}"

    return table(title, own(columns), rows, lambda r: line(r, columns)) + [""] + table(
        f"{title} (average over {unit})", own(average_columns) + " x full |", averages,
        lambda a: line(a, average_columns) + f" {fmt(a['x_full'], 2)} |")
