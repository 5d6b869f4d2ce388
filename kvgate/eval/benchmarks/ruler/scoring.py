"""RULER's scores (``scripts/eval/synthetic/constants.py``): case-insensitive substring match.

``string_match_all``: the share of the required values found in the prediction (every value
must be present for full credit); ``string_match_part``: 1 when any reference is present.
Both return percentages over the examples.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.eval.benchmarks.ruler.haystack import RulerError


def _check(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if len(preds) != len(refs) or not preds:
        raise RulerError(f"{len(preds)} predictions for {len(refs)} references")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    _check(preds, refs)
    return 100.0 * sum(sum(r.lower() in p.lower() for r in ref) / len(ref)
                       for p, ref in zip(preds, refs)) / len(preds)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    _check(preds, refs)
    return 100.0 * sum(max(r.lower() in p.lower() for r in ref)
                       for p, ref in zip(preds, refs)) / len(preds)


def score(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """The task's RULER score, in percent."""
    from kvgate.eval.benchmarks.ruler.tasks import SCORING

    if task not in SCORING:
        raise RulerError(f"unknown RULER task {task!r}")
    fn = string_match_part if SCORING[task] == "string_match_part" else string_match_all
    return fn(preds, refs)
