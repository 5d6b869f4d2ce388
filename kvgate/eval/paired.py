"""Paired differences (``--paired POLICY``): a row's score less the reference policy's on the
same examples, with a paired 95% interval.

Two policies scored on the same examples differ by less noise than their two intervals
suggest: the interval of the gap itself joins the two means' intervals with their correlation
on the examples (:func:`kvgate.eval.intervals.paired_share_interval`: MOVER, Newcombe's method
10 for hits; the mean over task families of the family differences, as the tables' averages
are). It holds at 0 and 100%: two policies that both answer all 96 examples differ by 0 [-3.8,
+3.8], not [0, 0] as a paired bootstrap said, since either could have missed one. A policy
against itself (the same records) differs by exactly 0, so its interval is [0, 0].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.eval.intervals import paired_share_interval
from kvgate.eval.store import ResultStore, make_key, split_key

Row = Mapping[str, Any]


def paired_difference(rows: Sequence[Row], reference: Sequence[Row],
                      seed: int = 0) -> dict[str, Any]:
    """Mean over families of ``rows[i]`` less ``reference[i]`` (records of the same family)
    on the examples both hold, and its 95% paired interval (in points; ``seed`` is kept for
    callers of the bootstrap it replaced)."""
    groups = []
    for mine, ref in zip(rows, reference):
        theirs = ref.get("examples", {})
        groups.append([(float(e["score"]), float(theirs[uid]["score"]))
                       for uid, e in mine.get("examples", {}).items() if uid in theirs])
    groups = [g for g in groups if g]
    if not groups:
        return {"n": 0, "diff": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    diff = sum(sum(a - b for a, b in g) / len(g) for g in groups) / len(groups)
    if all(mine is ref for mine, ref in zip(rows, reference)):
        lo = hi = 0.0  # the reference against itself: nothing could have gone otherwise
    else:
        lo, hi = paired_share_interval(groups)
    return {"n": sum(map(len, groups)), "diff": diff, "ci_low": lo, "ci_high": hi}


def average_paired(rows: Sequence[Row], groups: Mapping[tuple, Sequence[Row]], setting: tuple,
                   policy_at: int, budget_at: int, unit: str) -> dict[str, Any] | None:
    """The paired difference of an averaged row against the policy its records were paired
    with. ``rows``: the averaged row's records, one per ``unit`` ("family", "task");
    ``groups``: every averaged row's records by setting (a tuple holding the policy at
    ``policy_at`` and the budget at ``budget_at``); ``setting``: this row's. The reference's
    group is the one at the same setting, else its only budget there (``full``); units
    are matched one to one. None when nothing was paired or the reference is missing."""
    ref = next((r["paired"]["policy"] for r in rows if r.get("paired")), None)
    if ref is None:
        return None

    def rest(key: tuple) -> tuple:
        return tuple(v for i, v in enumerate(key) if i not in (policy_at, budget_at))

    same = setting[:policy_at] + (ref,) + setting[policy_at + 1:]
    found = [k for k in groups if k[policy_at] == ref and rest(k) == rest(setting)]
    key = same if same in groups else (found[0] if len(found) == 1 else None)
    if key is None:
        return None
    theirs = {r[unit]: r for r in groups[key]}
    mine = [r for r in rows if r[unit] in theirs]
    return {"policy": ref, **paired_difference(mine, [theirs[r[unit]] for r in mine])}


def reference_key(results: Mapping[str, Row], key: str, policy: str) -> str | None:
    """The key of ``policy`` beside ``key``: the same kind, task, budget and mode, else its
    only budget there (a budget-free policy such as ``full``), else None."""
    parts = split_key(key)
    same = make_key(parts["kind"], parts["task"], policy, parts["budget"], parts["mode"])
    if same in results:
        return same
    found = [k for k in results if k.startswith(f"{parts['kind']}|{parts['task']}|{policy}|")
             and k.endswith(f"|{parts['mode']}")]
    return found[0] if len(found) == 1 else None


def add_paired(store: ResultStore, keys: Sequence[str], policy: str, seed: int = 0) -> None:
    """Store beside each of ``keys`` its paired difference to ``policy`` (``paired``:
    policy, n, diff, ci_low, ci_high); a key without the reference beside it gets none."""
    results = store.results
    for key in keys:
        ref = reference_key(results, key, policy)
        if ref is None:
            continue
        results[key]["paired"] = {"policy": policy,
                                  **paired_difference([results[key]], [results[ref]], seed)}
        store.put(key, {k: v for k, v in results[key].items() if k != "examples"},
                  results[key]["examples"], results[key].get("complete", False))
