"""One result key scored example by example, resumable: what every benchmark's loop ends in.

:func:`run_resumable` skips the examples a key already holds, checks that the stored ones were
scored on the same tokens, settings and policy spec (:mod:`kvgate.eval.identity`), and saves
after every batch; :func:`evict_summary` is the %Evict every summary carries.

:class:`Tally` is a benchmark run's one progress display (:mod:`kvgate.progress`) over all its
(result key, example) pairs: each benchmark counts its plan before the first key
(:func:`planned_runs`) and hands the tally to every key it scores."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from kvgate.eval.identity import check_inputs, input_digest
from kvgate.eval.masked import ScoringItem
from kvgate.eval.store import ResultStore
from kvgate.policies.base import Budget, Policy
from kvgate.policies.registry import policy_spec
from kvgate.progress import Progress


class Tally:
    """The progress of a benchmark run over its (result key, example) pairs: ``pairs``, the
    plan, counted before anything runs; a pair stored by an earlier run leaves the plan when its
    key's turn comes; one scored ahead of its turn (a shared prefill's, :func:`add_records`)
    counts when it is scored. ``show`` false (``--no-progress`` / ``--quiet``): nothing is
    shown. A ``with`` block closes it."""

    def __init__(self, pairs: int, what: str, show: bool = True) -> None:
        self.progress = Progress(pairs, what, "example", quiet=not show)
        self.counted: set[tuple[str, str]] = set()

    def begin(self, key: str, items: Sequence[Any], done: Mapping[str, Any]) -> None:
        """``key``'s turn: its items stored before this run leave the plan."""
        self.progress.drop(sum(1 for it in items
                               if it.uid in done and (key, it.uid) not in self.counted))

    def scored(self, key: str, uids: Sequence[str]) -> None:
        self.counted.update((key, uid) for uid in uids)
        self.progress.advance(len(uids), note=key)

    def close(self) -> None:
        self.progress.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def planned_runs(policies: Mapping[str, Policy], budgets: Sequence[Budget]) -> int:
    """The (policy, budget) runs of a benchmark's keys: one per budget, one for a budget-free
    policy (each run of a task is one key, each key one pair per example)."""
    return sum(1 if policy.budget_free else len(budgets) for policy in policies.values())


def evict_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """%Evict as the sample mean of per-example ratios, and token-weighted."""
    recs = list(records.values())
    if not recs:
        return {"evict_pct": math.nan, "evict_pct_tokens": math.nan}
    kept = sum(r["kept"] for r in recs)
    total = sum(r["total"] for r in recs)
    return {"evict_pct": 100.0 * sum(r["evict"] for r in recs) / len(recs),
            "evict_pct_tokens": 100.0 * (1.0 - kept / max(total, 1))}


def run_resumable(store: ResultStore, key: str, items: Sequence[Any],
                  score: Callable[[list[Any]], list[dict[str, Any]]],
                  summarise: Callable[[Mapping[str, Any]], dict[str, Any]],
                  extra: Mapping[str, Any] | None = None, batch_size: int = 8,
                  progress: bool | Tally = True, policy: Policy | None = None
                  ) -> dict[str, Any]:
    """Score ``items`` (each with a ``uid``) under one key, skipping what is stored.

    ``score(batch)`` returns one record per item. Items go longest first (an out-of-memory
    shows at once, not at the end); the store is updated after every batch. A complete key
    asked for items it lacks (a larger ``--limit`` or ``--windows``) scores only those.
    ``policy``: its spec (name and options) is stored with the key, and a key stored with
    another spec is refused (a label reused with other options would mix two policies), as is
    one stored with other settings or an example scored on other tokens
    (:mod:`kvgate.eval.identity`).
    ``progress``: the run's :class:`Tally`, or whether to show this key's own.
    """
    done, digests, extra = _opened(store, key, items, extra, policy)
    tally = progress if isinstance(progress, Tally) else Tally(len(items), key, progress)
    tally.begin(key, items, done)
    if store.is_complete(key) and all(it.uid in done for it in items):
        if tally is not progress:
            tally.close()
        return store.results[key]
    todo = sorted((it for it in items if it.uid not in done), key=lambda it: -item_size(it))
    batches = [todo[i: i + batch_size] for i in range(0, len(todo), max(1, batch_size))]
    for batch in batches:
        for it, rec in zip(batch, score(batch)):
            done[it.uid] = {**rec, "input": digests[it.uid]}
        store.put(key, {**extra, **summarise(done)}, done, complete=False)
        tally.scored(key, [it.uid for it in batch])
    if tally is not progress:
        tally.close()
    wanted = {it.uid for it in items}
    final = {uid: r for uid, r in done.items() if uid in wanted}
    store.put(key, {**extra, **summarise(final)}, final, complete=True)
    return store.results[key]


def add_records(store: ResultStore, key: str, scored: Sequence[tuple[Any, dict[str, Any]]],
                summarise: Callable[[Mapping[str, Any]], dict[str, Any]],
                extra: Mapping[str, Any] | None = None, policy: Policy | None = None,
                tally: Tally | None = None) -> None:
    """Store records of ``key`` scored ahead of its own turn (``scored``: (item, record)),
    checked as :func:`run_resumable` checks its own and kept partial until that turn (and
    counted in the run's ``tally``).

    Work one forward does for many keys (a shared prefill, a shared repeat pass) is stored
    as soon as it is done (on disk with the store's next write, as a key's own batches are),
    so a kill loses no more of it than of a key's own work, and the key's turn skips it.
    """
    done, digests, extra = _opened(store, key, [it for it, _ in scored], extra, policy)
    for it, rec in scored:
        done[it.uid] = {**rec, "input": digests[it.uid]}
    store.put(key, {**extra, **summarise(done)}, done, complete=False)
    if tally is not None:
        tally.scored(key, [it.uid for it, _ in scored])


def _opened(store: ResultStore, key: str, items: Sequence[Any],
            extra: Mapping[str, Any] | None, policy: Policy | None,
            ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(stored records, input digests of ``items``, extra with the policy's spec) of ``key``
    after refusing a stored spec, setting or example that differs."""
    # as it reads back from the file, so a stored spec compares equal
    spec = None if policy is None else json.loads(json.dumps(policy_spec(policy)))
    store.check_spec(key, spec)
    done = store.examples(key)
    digests = {it.uid: input_digest(it) for it in items}
    check_inputs(store.path, key, done, digests)
    extra = dict(extra or {})
    if spec is not None:
        extra["spec"] = spec
    return done, digests, extra


def item_size(item: Any) -> int:
    """Tokens a scoring item puts through the model (its batching cost)."""
    if isinstance(item, ScoringItem):
        return len(item.context) + sum(map(len, item.choices))
    return len(getattr(item, "ids", ()))
