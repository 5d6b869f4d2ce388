"""Ada-KV: adaptive per-head budgets inside a layer, wrapping a score policy.

Paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference" (first version: "Optimizing KV Cache Eviction in LLMs: Adaptive Allocation for
Enhanced Budget Utilization"), Feng et al. 2024, arXiv:2407.11550. Rule: heads differ in how
concentrated their attention is, so instead of the same count per head, a layer's budget goes
to the highest scores of the whole layer (a head with concentrated attention gives up entries
to one whose attention is spread), with a floor per head.

The inner policy (SnapKV -> Ada-SnapKV, PyramidKV -> Ada-Pyramid, H2O -> Ada-H2O) gives
per-head scores whose scale is comparable across heads, its forced entries (window / recent)
and the layer's per-head budget ``B``. With ``B_base`` = B minus the forced entries::

    c_h   = entries of head h among the top H_kv * B_base scores of the whole layer
    B_h   = round((1 - alpha) * c_h + floor(alpha * B_base))      (official; alpha floor)
    keep_h = forced_h + top-B_h of head h

Rounding and the floor make the layer total drift from ``H_kv * B`` (by about a token per
head); ``exact=True`` distributes ``(1 - alpha) * c_h + alpha * B_base`` by largest remainder
(ties to the larger c_h, then the lower head) so the layer total is exact. Per-head counts vary
by design; the per-layer total is the budget. ``alpha`` defaults to 0.2 like the reference
code and kvpress (the paper says 0.5). Layers below ``skip`` use uniform budgets.
AhaKV / NaCl / RoCo scores are not comparable across heads, so they are not accepted inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    ScoredPolicy,
    check_int,
    check_prompt,
    keep_all,
    option_error,
    select_topk,
)
from kvgate.policies.h2o import H2O
from kvgate.policies.pyramidkv import PyramidKV
from kvgate.policies.snapkv import SnapKV

INNER: dict[str, type[ScoredPolicy]] = {"snapkv": SnapKV, "pyramidkv": PyramidKV, "h2o": H2O}


def allocate_heads(scores: Tensor, candidates: Tensor, base: Tensor, alpha: float,
                   exact: bool = False) -> tuple[Tensor, Tensor]:
    """Per-head selected budgets from a layer-wide top-k.

    scores [B, Hk, n] float; candidates [B, Hk, n] bool (entries that may be selected: real and
    not forced); base [B, Hk] long (uniform selected budget per head). Returns ``(c, alloc)``,
    both [B, Hk] long: c = each head's share of the layer-wide top ``sum(base)`` (ties toward
    the lower head, then the lower index) and alloc = the selected budget of each head.
    """
    b, hk, n = scores.shape
    quota = base.sum(-1)
    flat = scores.float().reshape(b, 1, hk * n)
    chosen = select_topk(flat, quota, None, candidates.reshape(b, 1, hk * n))
    c = chosen.view(b, hk, n).sum(-1)
    if exact:
        target = (1.0 - alpha) * c.double() + alpha * base.double()
        low = torch.floor(target + 1e-9).long()
        left = (quota - low.sum(-1)).clamp(min=0)
        # rank heads by remainder (rounded, so float noise cannot decide), then by c_h
        remainder = torch.round((target - low.double()) * 1e6).long()
        order_key = remainder * (n * hk + 1) + c
        order = torch.sort(order_key, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(hk, device=scores.device).expand(b, hk))
        alloc = low + (rank < left[:, None]).long()
    else:
        floor = torch.floor(alpha * base.double() + 1e-9)
        alloc = torch.round((1.0 - alpha) * c.double() + floor).long()
    return c, torch.minimum(alloc, candidates.sum(-1))


@dataclass
class AdaKV(ScoredPolicy):
    """Ada-KV allocation around ``inner`` (a name in ``INNER`` or a policy instance)."""

    inner: Any = "snapkv"
    inner_options: dict = field(default_factory=dict)
    alpha: float = 0.2
    exact: bool = False
    normalize: bool = False
    skip: int = 0

    name = "adakv"

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):
            if self.inner not in INNER:
                raise option_error(self.name, "inner", f"must be one of {', '.join(INNER)} "
                                   "(scores comparable across heads)", self.inner)
            try:
                self.inner = INNER[self.inner](**self.inner_options)
            except TypeError as exc:
                raise option_error(self.name, "inner_options", f"not options of {self.inner}",
                                   self.inner_options) from exc
        elif isinstance(self.inner, tuple(INNER.values())):
            if self.inner_options:
                raise option_error(self.name, "inner_options",
                                   "only used when inner is given by name", self.inner_options)
        else:
            raise option_error(self.name, "inner", f"must be one of {', '.join(INNER)} or an "
                               "instance of one", self.inner)
        if self.inner.allocation != "head":  # every INNER class takes the option
            raise option_error(self.name, "inner", "reallocates within each layer: its inner "
                               "policy keeps allocation=head", self.inner)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not 0.0 <= self.alpha <= 1.0:
            raise option_error(self.name, "alpha", "must lie in [0, 1]", self.alpha)
        for flag in ("exact", "normalize"):
            if not isinstance(getattr(self, flag), bool):
                raise option_error(self.name, flag, "must be true or false", getattr(self, flag))
        check_int(self.name, "skip", self.skip, 0)

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        return self.inner.scores(prompt, budget)

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        return self.inner.forced(prompt, kept)

    def layer_budget(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        return self.inner.layer_budget(prompt, kept)

    def head_budgets(self, prompt: LayerPrompt, budget: Budget) -> tuple[Tensor, Tensor, Tensor]:
        """(scores [B, Hk, n], forced [B, Hk, n], per-head totals [B, Hk] long incl. forced)."""
        valid = prompt.valid
        kept = self.layer_budget(prompt, budget.per_sample(prompt.n_real))
        scores = self.scores(prompt, budget)
        forced = self.forced(prompt, kept) & valid[:, None, :]
        n_forced = forced.sum(-1)
        base = (kept[:, None] - n_forced).clamp(min=0)
        if prompt.layer_idx < self.skip or self.alpha >= 1.0:
            return scores, forced, n_forced + base
        candidates = valid[:, None, :] & ~forced
        if self.normalize:
            scores = self.normalized(scores, candidates, base)
        _, alloc = allocate_heads(scores, candidates, base, float(self.alpha), self.exact)
        return scores, forced, n_forced + alloc

    @staticmethod
    def normalized(scores: Tensor, candidates: Tensor, base: Tensor) -> Tensor:
        """Scale head h by (its top-``base`` mass) / (its total mass) before the layer top-k."""
        s = scores.float().masked_fill(~candidates, 0.0)
        top = select_topk(s, base, None, candidates)
        ratio = (s * top).sum(-1) / s.sum(-1).clamp(min=1e-12)
        return scores * ratio[..., None]

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool; per-head counts differ, the per-layer total is the budget."""
        check_prompt(prompt)
        kept = self.layer_budget(prompt, budget.per_sample(prompt.n_real))
        if bool((kept >= prompt.n_real).all()):
            return keep_all(prompt)
        scores, forced, per_head = self.head_budgets(prompt, budget)
        return select_topk(scores, per_head, forced, prompt.valid)


__all__ = ["INNER", "AdaKV", "allocate_heads"]
