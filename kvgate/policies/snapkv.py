"""SnapKV: an observation window of the last ``w`` prompt rows votes for the entries to keep.

Paper: "SnapKV: LLM Knows What You are Looking for Before Generation", Li et al. 2024,
arXiv:2404.14469. Rule: the attention the prompt's last rows pay to each earlier key predicts
what generation will attend to; keep the keys they attend to most (pooled so that neighbours of
a hit survive with it) plus the window itself. One shot at the prefill; decoding does not evict.

``s_j`` = the window rows' attention to key j (softmax over the whole causal row in fp32, then
sliced), aggregated over the GQA group *before* pooling (Ada-KV / KVCache-Factory order; kvpress
pools first), then pooled along the keys. Keep = top ``B - w`` of ``s`` outside the window +
the window itself (the budget includes the window).

Defaults follow the LongBench configuration used by the SnapKV / Ada-KV / AhaKV comparisons:
``window=32, kernel=7, pooling="max"`` (the SnapKV code default is avg pooling, kernel 5).
``aggregate`` sums the window rows (SnapKV) or averages them (Ada-KV, kvpress): same ranking.
A budget smaller than the window keeps the last ``B`` tokens (the window is clipped).
``window`` may also be a float share of the prompt (``0.1`` = its last 10%, at least one
token): the papers' 32 rows were chosen for LongBench prompts of thousands of tokens, and on
a 60-token prompt at 50% a 32-token window is the whole budget, i.e. a local window.
``allocation`` (``AllocationOption``): ``"head"`` or ``"global"`` (the pooled votes divided by
their per-(layer, head) sum outside the window, which is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import (
    AllocationOption,
    Budget,
    LayerPrompt,
    ScoredPolicy,
    attention_sums,
    check_choice,
    check_int,
    gqa_reduce,
    last_real,
    option_error,
    pool1d,
    resolve_share,
)


@dataclass
class SnapKV(ScoredPolicy, AllocationOption):
    """Window-voted, pooled attention scores; the window is always kept."""

    window: int | float = 32
    kernel: int = 7
    pooling: str = "max"
    aggregate: str = "mean"
    gqa: str = "mean"

    name = "snapkv"

    def __post_init__(self) -> None:
        self.check_allocation()
        if isinstance(self.window, float):
            if not 0.0 < self.window <= 1.0:
                raise option_error(self.name, "window", "a float share must lie in (0, 1]",
                                   self.window)
        else:
            check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise option_error(self.name, "kernel", "must be odd (same-length pooling)",
                               self.kernel)
        check_choice(self.name, "pooling", self.pooling, ("avg", "max"))
        check_choice(self.name, "aggregate", self.aggregate, ("mean", "sum"))
        check_choice(self.name, "gqa", self.gqa, ("mean", "max"))

    def window_tokens(self, n_real: Tensor) -> Tensor:
        """Observation-window rows per sample ([B] long, at least 1, at most the prompt)."""
        return torch.minimum(resolve_share(self.window, n_real).clamp(min=1), n_real.clamp(min=1))

    def window_len(self, kept: Tensor, n_real: Tensor) -> Tensor:
        """Window entries inside a budget of ``kept`` per head ([B] or [B, H_kv]; clipped to
        the budget)."""
        w = self.window_tokens(n_real)
        return torch.minimum(kept, w.view(-1, *([1] * (kept.dim() - 1))))

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """Pooled window votes ``[B, H_kv, n]``; window and padding columns hold 0."""
        n = prompt.query.shape[2]
        w = self.window_tokens(prompt.n_real)
        window = last_real(prompt.valid, w)
        sums = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                              n - int(w.max()), row_weight=window[:, 0])
        if self.aggregate == "mean":
            sums = sums / w.view(-1, 1, 1).to(sums.dtype)
        s = gqa_reduce(sums, prompt.key.shape[1], self.gqa)
        prefix = prompt.valid[:, None, :] & ~window
        # pool the prefix only, so window votes never leak into their neighbours' scores
        return pool1d(s, self.kernel, self.pooling, mask=prefix).masked_fill(~prefix, 0.0)

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        return last_real(prompt.valid, self.window_len(kept, prompt.n_real)).expand(b, hk, n)
