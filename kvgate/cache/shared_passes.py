"""One prefill and one run of the extra passes, many ``PassScoring`` variants: ``SharedPasses``.

Why this is exact: a ``PassScoring`` policy (KVzip) stores the whole prompt, runs its passes
over that full cache (the passes store nothing) and only then chooses. Variants whose
``pass_key`` is equal read the very same passes and see the very same attention; they differ
in how a block of rows is scored (``scorer_key``: KVzip against KVzip+) and in the choice
(budget, allocation, sinks). So one prefill and one run of the passes can raise the running
maximum of every distinct scorer at once, and each variant's cache is then a fork of the full
cache chosen under its own policy and budget: what that variant builds alone, entry for entry
(``tests/cache/test_shared_passes.py``). An evaluation of KVzip and KVzip+ at three budgets
and two allocations pays one repeat pass instead of twelve.

``share_group`` says which evaluation variants can be served together: one-shot policies by a
``SharedPrefill``, ``PassScoring`` ones with equal ``pass_key`` by a ``SharedPasses``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.cache.compressed import CompressedCache
from kvgate.cache.errors import CacheError
from kvgate.cache.fork import fork_layer
from kvgate.cache.passes import choose_all
from kvgate.cache.ragged import RaggedStore
from kvgate.cache.shared import shares_prefill
from kvgate.models.load import sync_device
from kvgate.policies.contract import Budget, PassAttention, PassScoring, Policy, PolicyError


def share_group(policy: Policy) -> Hashable | None:
    """Which shared run can serve ``policy`` in a question-agnostic evaluation: ``"prefill"``
    (a ``SharedPrefill``), ``("passes", key)`` (a ``SharedPasses`` of that ``pass_key``), or
    None (it runs on its own)."""
    if shares_prefill(policy):
        return "prefill"
    if isinstance(policy, PassScoring):
        return ("passes", policy.pass_key())
    return None


class SharedPasses(CompressedCache):
    """A full cache whose prefill and extra passes serve every ``variants[name] = (policy,
    budget)``, all ``PassScoring`` with one ``pass_key``. Prefill it and run the passes without
    the choice (``kvgate.inference.compress.prefill_rows(..., choose=False)``), then ``split``.

    Each layer's running scores hold one row per distinct ``scorer_key``: ``[S, B, H_kv, T]``.
    """

    def __init__(self, model_or_config: nn.Module | Any,
                 variants: Mapping[str, tuple[Policy, Budget | float | str]]) -> None:
        if not variants:
            raise PolicyError("SharedPasses needs at least one (policy, budget)")
        keys = set()
        for name, (policy, _) in variants.items():
            if not isinstance(policy, PassScoring):
                raise PolicyError(f"{name}: policy {policy.name!r} runs no extra passes, so it "
                                  "cannot share a PassScoring policy's")
            keys.add(policy.pass_key())
        if len(keys) > 1:
            raise PolicyError("SharedPasses needs variants that read the same passes; got pass "
                              f"keys {sorted(map(str, keys))}")
        lead = next(iter(variants.values()))[0]
        super().__init__(model_or_config, lead, Budget(ratio=1.0))
        self.variants = {name: (policy, Budget.parse(budget))
                         for name, (policy, budget) in variants.items()}
        self.scorers: dict[Hashable, PassScoring] = {}
        for policy, _ in self.variants.values():
            self.scorers.setdefault(policy.scorer_key(), policy)
        self._row = {key: i for i, key in enumerate(self.scorers)}

    def new_pass_scores(self, store: RaggedStore) -> Tensor:
        return torch.zeros(len(self.scorers), store.batch, store.kv_heads, store.base_len,
                           device=store.device)

    def score_pass(self, part: PassAttention) -> Tensor:
        return torch.stack([s.pass_scores(part).float() for s in self.scorers.values()])

    def split(self) -> tuple[dict[str, CompressedCache], dict[str, float]]:
        """Each variant's cache, chosen from its scorer's running scores under its own policy
        and budget, and the seconds its choice took. This cache is left as it was."""
        if not self.awaiting_passes or any(layer.scores is None for layer in self.layers):
            raise CacheError("split a SharedPasses after its prefill and passes, before any "
                             "choice (prefill_rows(..., choose=False))")
        caches, seconds = {}, {}
        device = self.layers[0].store.device
        for name, (policy, budget) in self.variants.items():  # a loop over variants
            sync_device(device)
            t0 = time.perf_counter()
            row = self._row[policy.scorer_key()]
            cache = CompressedCache(self.model_config, policy, budget)
            cache.layers = []
            for layer in self.layers:  # a loop over layers
                twin = fork_layer(layer)
                twin.scores, twin.forced = layer.scores[row], None
                cache.layers.append(twin)
            cache.awaiting_passes = True
            choose_all(cache)
            sync_device(device)
            caches[name], seconds[name] = cache, time.perf_counter() - t0
        return caches, seconds


__all__ = ["SharedPasses", "share_group"]
