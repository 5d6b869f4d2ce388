"""results.md and the plots of an output folder, drawn from its stored results
(:mod:`kvgate.eval.store`). Each kind of result draws its own tables and figures (the
``Report`` its benchmark registers with its command, :mod:`kvgate.eval.registry`); this module
puts them together in the order it is given and names no benchmark."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvgate.eval.command import Report
from kvgate.eval.store import ResultStore

TABLE = "results.md"


def markdown_table(results: Iterable[dict[str, Any]], reports: Sequence[Report]) -> str:
    """The tables of each report's kind, in ``reports``' order (a kind without rows or without
    a report draws none)."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r)
    parts = [text for report in reports if (text := report.markdown(by_kind.get(report.kind, [])))]
    return "\n\n".join(parts) + "\n"


def write_table(store: ResultStore, reports: Sequence[Report]) -> Path:
    path = store.dir / TABLE
    path.write_text(markdown_table(store.complete_results(), reports), encoding="utf-8")
    return path


def write_outputs(store: ResultStore, reports: Sequence[Report]) -> list[Path]:
    """The store saved, results.md and every plot the stored results allow; returns the files
    written."""
    store.save()
    results = store.complete_results()
    paths = [write_table(store, reports)]
    for report in reports:
        if report.plots is not None:
            paths += report.plots([r for r in results if r.get("kind") == report.kind],
                                  store.dir)
    return paths
