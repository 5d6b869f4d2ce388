"""AhaKV: step-gain softmax, recent accumulation and a value prior.

Paper: "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of
Large Language Models", Gu et al. 2025, arXiv:2506.03762. Rule: accumulated attention is
biased toward early tokens, so score each key by the attention of the most recent rows only,
under a softmax sharpened by how much must be evicted, weighted by its value vector's norm;
keep the top scores plus the recent rows, and keep accumulating while decoding.

- SG-softmax: the scaled logits ``q.k / sqrt(d)`` are multiplied by
  ``lambda' = sqrt(2 ln(n / B))`` (0 when n <= B) before the softmax. This is the paper's eq. 12
  ``lambda = sqrt(2 ln(i / k) / d)`` moved onto the already-scaled logits (lambda' = lambda
  sqrt(d)): applied to raw dot products it replaces the 1/sqrt(d) scale.
- Recent accumulation: ``F_j`` = sum of the last ``recent`` (B_r = 32) rows' SG-softmax.
- Value prior: ``nu_j = ||v_j||^2`` per KV head, mean-filtered (avg pool, ``kernel`` 7, same
  padding; ``count_include_pad`` True like PyTorch's default, which lowers the edge scores),
  divided by its maximum over the prompt, multiplies F.
- Keep = top F-hat outside the last B_r + the last B_r (the budget includes them).

``lambda_mode``: ``prefill_fixed`` (default) computes lambda' once at prefill (i = n, k = B)
and reuses it while decoding; ``per_row`` uses each row's length (i = visible entries,
k = B or the capacity); ``none`` uses lambda' = 1 (plain softmax). Decode adds each new row's
SG-softmax to F (new entries start at 0), never re-applies the value prior, and keeps the
B_r newest entries plus the top F.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import (
    Budget,
    DecodeEvicting,
    LayerPrompt,
    PolicyError,
    ScoredPolicy,
    attention_sums,
    by_position,
    check_choice,
    check_decode,
    check_int,
    gqa_reduce,
    last_real,
    option_error,
    pool1d,
    real_index,
    select_topk,
    stat,
)


def sg_lambda(length: Tensor | float, budget: Tensor | float) -> Tensor:
    """lambda' = sqrt(2 ln(length / budget)) on scaled logits; 0 where length <= budget."""
    length = torch.as_tensor(length, dtype=torch.float64)
    budget = torch.as_tensor(budget, dtype=torch.float64, device=length.device)
    ratio = length / budget.clamp(min=1.0)
    return torch.where(ratio > 1.0, torch.sqrt(2.0 * torch.log(ratio.clamp(min=1.0))),
                       torch.zeros_like(ratio)).float()


def value_weights(value: Tensor, valid: Tensor, kernel: int, count_include_pad: bool = True,
                ) -> Tensor:
    """gamma-bar: mean-filtered squared value norms over their max. value [B, Hk, n, d],
    valid [B, n] -> [B, Hk, n] in [0, 1] (0 at padding)."""
    nu = value.float().square().sum(-1).masked_fill(~valid[:, None, :], 0.0)
    gamma = pool1d(nu, kernel, "avg", mask=valid[:, None, :],
                   count_include_pad=count_include_pad).masked_fill(~valid[:, None, :], 0.0)
    return gamma / gamma.amax(-1, keepdim=True).clamp(min=1e-12)


@dataclass
class AhaKV(ScoredPolicy, DecodeEvicting):
    """SG-softmax recent accumulation times a value prior; the last ``recent`` are kept."""

    recent: int = 32
    kernel: int = 7
    value_prior: bool = True
    count_include_pad: bool = True
    lambda_mode: str = "prefill_fixed"
    gqa: str = "mean"

    name = "ahakv"

    def __post_init__(self) -> None:
        check_int(self.name, "recent", self.recent, 1)
        check_int(self.name, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise option_error(self.name, "kernel", "must be odd (same-length pooling)",
                               self.kernel)
        for flag in ("value_prior", "count_include_pad"):
            if not isinstance(getattr(self, flag), bool):
                raise option_error(self.name, flag, "must be true or false", getattr(self, flag))
        check_choice(self.name, "lambda_mode", self.lambda_mode,
                     ("prefill_fixed", "per_row", "none"))
        check_choice(self.name, "gqa", self.gqa, ("mean", "max"))

    def prefill_lambda(self, prompt: LayerPrompt, kept: Tensor) -> Tensor | None:
        """lambda' per sample [B] (prefill_fixed), per row [B, n] (per_row) or None."""
        if self.lambda_mode == "none":
            return None
        if self.lambda_mode == "per_row":
            return sg_lambda(real_index(prompt.valid) + 1, kept[:, None])
        return sg_lambda(prompt.n_real, kept)

    def scores_for(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        """F-hat ``[B, H_kv, n]`` for a per-head budget ``kept`` ([B] long)."""
        n = prompt.query.shape[2]
        sums = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                              n - self.recent, logit_scale=self.prefill_lambda(prompt, kept))
        f = gqa_reduce(sums, prompt.key.shape[1], self.gqa)
        if self.value_prior:
            f = f * value_weights(prompt.value, prompt.valid, self.kernel, self.count_include_pad)
        return f

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        if budget is None and self.lambda_mode != "none":
            raise PolicyError("ahakv.scores needs the budget: lambda' = sqrt(2 ln(n / B))")
        kept = budget.per_sample(prompt.n_real) if budget is not None else prompt.n_real
        return self.scores_for(prompt, kept)

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        return last_real(prompt.valid, kept.clamp(max=self.recent)).expand(b, hk, n)

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        """``{"score": F-hat, "lam": lambda'}``, each [B, H_kv, n]; the budget is read from
        ``keep``'s per-head count. ``lam`` rides along as a per-slot copy of the prefill value
        so that it survives the cache's gathering (new slots get 0; the max is read back)."""
        b, hk, n = prompt.key.shape[:3]
        kept = keep[:, 0].sum(-1).clamp(min=1)
        lam = sg_lambda(prompt.n_real, kept) if self.lambda_mode == "prefill_fixed" \
            else torch.ones(b)
        lam = lam.to(prompt.key.device).view(b, 1, 1).expand(b, hk, n).contiguous()
        return {"score": self.scores_for(prompt, kept), "lam": lam}

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """F += SG-softmax of the new rows; keep the ``recent`` newest + top F."""
        check_decode(logits, valid, positions, capacity)
        b, h = logits.shape[:2]
        hk = valid.shape[1]
        finite = torch.isfinite(logits)
        lam_slots = stat(stats, "lam", valid).masked_fill(~valid, 0.0)
        if self.lambda_mode == "per_row":
            cap = capacity.repeat_interleave(h // hk, dim=1)[..., None]
            scale = sg_lambda(finite.sum(-1), cap).to(logits.device)[..., None]
        elif self.lambda_mode == "prefill_fixed":
            scale = lam_slots.amax(-1).repeat_interleave(h // hk, dim=1)[:, :, None, None]
        else:
            scale = torch.ones((b, h, 1, 1), device=logits.device)
        scaled = torch.where(finite, logits.float() * scale, torch.full_like(logits.float(),
                                                                             -math.inf))
        rows = torch.nan_to_num(torch.softmax(scaled, dim=-1), nan=0.0).sum(2)
        score = (stat(stats, "score", valid) + gqa_reduce(rows, hk, self.gqa))
        score = score.masked_fill(~valid, 0.0)
        recent = by_position(positions, valid, capacity.clamp(max=self.recent), newest=True)
        lam_out = lam_slots.amax(-1, keepdim=True).expand_as(lam_slots).contiguous()
        return {"score": score, "lam": lam_out}, select_topk(score, capacity, recent, valid)
