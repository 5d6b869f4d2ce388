"""TOVA, Token Omission Via Attention.

Paper: "Transformers are Multi-State RNNs", Oren et al. 2024, arXiv:2401.06104. Rule: when the
cache is over budget, drop the entry the newest query attends to least (attention averaged
over the heads); at the prefill, keep the top-``B`` entries by the last prompt row's attention.

The score is the last query row's attention averaged over *all* query heads of the layer, so
every KV head of a layer keeps the same tokens. No sinks, no window: the whole budget goes
to the top scores (the current token usually survives on its own self-attention).
``allocation`` (``AllocationOption``): ``"head"`` or ``"global"`` (the last row's attention
sums to one in every layer already; divided by its sum over the candidates all the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import (
    AllocationOption,
    Budget,
    DecodeEvicting,
    LayerPrompt,
    ScoredPolicy,
    attention_sums,
    check_decode,
    decode_probs,
    gqa_reduce,
    select_topk,
)


def shared_by_position(per_head: Tensor, valid: Tensor, positions: Tensor, group: int) -> Tensor:
    """Average per-slot scores over every query head that holds the same token position.

    per_head [B, H_kv, T]: the sum over each KV head's ``group`` query heads; valid and
    positions [B, H_kv, T]. Aligning by position (not by slot) keeps the result right even if
    heads store their entries in different slot orders. Returns [B, H_kv, T].
    """
    b = valid.shape[0]
    width = int(positions.max().clamp(min=0)) + 2  # last index collects invalid slots
    index = torch.where(valid, positions, torch.full_like(positions, width - 1)).view(b, -1)
    total = per_head.new_zeros((b, width)).scatter_add_(1, index, per_head.reshape(b, -1))
    heads = per_head.new_zeros((b, width)).scatter_add_(
        1, index, valid.reshape(b, -1).to(per_head.dtype) * group)
    mean = total / heads.clamp(min=1.0)
    return mean.gather(1, index).view_as(per_head)


@dataclass
class TOVA(ScoredPolicy, DecodeEvicting, AllocationOption):
    """Keep the top-``B`` tokens by the last row's head-averaged attention (shared per layer)."""

    name = "tova"

    def __post_init__(self) -> None:
        self.check_allocation()

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]``: identical rows across KV heads (mean over all query heads)."""
        n = prompt.query.shape[2]
        last = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling, n - 1)
        b, hk = prompt.key.shape[:2]
        return last.mean(1, keepdim=True).expand(b, hk, n)

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        return {}  # TOVA looks at the current row only

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Keep the ``capacity`` slots with the highest head-averaged attention of the newest
        row (an argmin eviction when one entry is over). Returns (stats, [B, H_kv, T])."""
        check_decode(logits, valid, positions, capacity)
        hk = valid.shape[1]
        per_head = gqa_reduce(decode_probs(logits[:, :, -1]), hk, "sum")
        score = shared_by_position(per_head, valid, positions, logits.shape[1] // hk)
        return stats, select_topk(score, capacity, None, valid)
