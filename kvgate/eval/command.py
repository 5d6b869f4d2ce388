"""What the registry holds for each ``kvgate eval`` command (:mod:`kvgate.eval.registry`): its
config class, its run function and the report of the results it stores.

Kept free of torch and of every benchmark: the registry is read to build the command line,
and each benchmark's ``command`` module builds its own ``Command`` from this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class Report:
    """How the results of one ``kind`` (the first part of their keys) are shown: ``markdown``
    draws its tables from the complete rows of that kind ('' when it has none), ``plots``
    writes its figures into a folder and returns their paths."""

    kind: str
    markdown: Callable[[Sequence[Row]], str]
    plots: Callable[[Sequence[Row], Path], list[Path]] | None = None


@dataclass(frozen=True)
class Command:
    """One ``kvgate eval NAME``: ``config``'s fields are its flags (:mod:`kvgate.eval.options`);
    ``run(cfg, load)`` runs it (``load`` replaces the model loader) and returns an
    ``EvalOutput`` whose results.md and plots the registry then writes, or an output of its
    own that has ``paths`` and ``table()``; ``report``: how its kind of results is shown."""

    config: type
    run: Callable[..., Any]
    report: Report | None = None
