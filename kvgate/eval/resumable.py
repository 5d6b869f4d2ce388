"""One result key scored example by example, resumable: what every benchmark's loop ends in.

:func:`run_resumable` skips the examples a key already holds, checks that the stored ones were
scored on the same tokens, settings and policy spec (:mod:`kvgate.eval.identity`), and saves
after every batch; :func:`evict_summary` is the %Evict every summary carries."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvgate.eval.identity import check_inputs, input_digest
from kvgate.eval.masked import ScoringItem
from kvgate.eval.store import ResultStore
from kvgate.policies.base import Policy
from kvgate.policies.registry import policy_spec


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
                  progress: bool = True, policy: Policy | None = None) -> dict[str, Any]:
    """Score ``items`` (each with a ``uid``) under one key, skipping what is stored.

    ``score(batch)`` returns one record per item. Items go longest first (an out-of-memory
    shows at once, not at the end); the store is updated after every batch. A complete key
    asked for items it lacks (a larger ``--limit`` or ``--windows``) scores only those.
    ``policy``: its spec (name and options) is stored with the key, and a key stored with
    another spec is refused (a label reused with other options would mix two policies), as is
    one stored with other settings or an example scored on other tokens
    (:mod:`kvgate.eval.identity`).
    """
    done, digests, extra = _opened(store, key, items, extra, policy)
    if store.is_complete(key) and all(it.uid in done for it in items):
        return store.results[key]
    todo = sorted((it for it in items if it.uid not in done), key=lambda it: -item_size(it))
    batches = [todo[i: i + batch_size] for i in range(0, len(todo), max(1, batch_size))]
    for batch in tqdm(batches, desc=key, disable=not progress, leave=False):
        for it, rec in zip(batch, score(batch)):
            done[it.uid] = {**rec, "input": digests[it.uid]}
        store.put(key, {**extra, **summarise(done)}, done, complete=False)
    wanted = {it.uid for it in items}
    final = {uid: r for uid, r in done.items() if uid in wanted}
    store.put(key, {**extra, **summarise(final)}, final, complete=True)
    return store.results[key]


def add_records(store: ResultStore, key: str, scored: Sequence[tuple[Any, dict[str, Any]]],
                summarise: Callable[[Mapping[str, Any]], dict[str, Any]],
                extra: Mapping[str, Any] | None = None, policy: Policy | None = None) -> None:
    """Store records of ``key`` scored ahead of its own turn (``scored``: (item, record)),
    checked as :func:`run_resumable` checks its own and kept partial until that turn.

    Work one forward does for many keys (a shared prefill, a shared repeat pass) is stored
    as soon as it is done (on disk with the store's next write, as a key's own batches are),
    so a kill loses no more of it than of a key's own work, and the key's turn skips it.
    """
    done, digests, extra = _opened(store, key, [it for it, _ in scored], extra, policy)
    for it, rec in scored:
        done[it.uid] = {**rec, "input": digests[it.uid]}
    store.put(key, {**extra, **summarise(done)}, done, complete=False)


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
