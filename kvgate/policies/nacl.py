"""NaCl: proxy-token scores + random eviction, one shot at encoding.

Paper: "NaCl: A General and Effective KV Cache Eviction Framework for LLMs at Inference Time",
Chen et al. 2024, arXiv:2408.03675. Rule: score each key by the attention of a few proxy rows
(the end of the prompt, closest to the question) and keep the top of those scores, but spend a
share of the budget on entries sampled at random in proportion to their scores, which hedges
against the proxy's bias; sinks and the last tokens are protected.

``F_j`` = sum over the proxy rows (the last ``proxy`` prompt tokens, causal) of the attention
to key j, per head (GQA: ``gqa`` over the group). Per head, the budget ``B`` is split as::

    sinks (first ``sinks``) + protected recent (last ``protect``)
    + C_r = floor(random_share * B) sampled without replacement from softmax(F) over the rest
    + C_p = the remainder, taken as the top F                              (sinks/protect first)

``random_share=0.35`` is the Paddle reference's split (7% random of a 20% budget). Sampling
uses the Gumbel-top-k trick (keys F + Gumbel noise), which is exactly successive sampling
without replacement from softmax(F). The noise comes from a CPU ``torch.Generator`` seeded from
(seed, layer_idx), drawn position-major and indexed by each token's index among the real
tokens, so every head gets its own stream and a left-padded sample draws the same set as the
sample alone. Decoding does not evict (the released code only evicts at encoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    ScoredPolicy,
    attention_sums,
    check_choice,
    check_int,
    check_prompt,
    check_share,
    first_real,
    gqa_reduce,
    keep_all,
    last_real,
    option_error,
    resolve_share,
    seeded_uniform,
    select_topk,
)


@dataclass
class NaCl(ScoredPolicy):
    """Sinks + protected recent + proxy top set + seeded random sample, per (layer, head)."""

    proxy: float | int = 0.01
    sinks: int = 4
    protect: float | int = 0.01
    random_share: float = 0.35
    seed: int = 0
    gqa: str = "mean"

    name = "nacl"

    def __post_init__(self) -> None:
        check_share(self.name, "proxy", self.proxy)
        check_int(self.name, "sinks", self.sinks, 0)
        check_share(self.name, "protect", self.protect)
        if isinstance(self.random_share, bool) or not isinstance(self.random_share, (int, float)) \
                or not 0.0 <= self.random_share <= 1.0:
            raise option_error(self.name, "random_share", "must lie in [0, 1]", self.random_share)
        check_int(self.name, "seed", self.seed, 0)
        check_choice(self.name, "gqa", self.gqa, ("mean", "max"))

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """Proxy-row column sums ``F`` ``[B, H_kv, n]`` (at least one proxy row per sample)."""
        n = prompt.query.shape[2]
        rows = resolve_share(self.proxy, prompt.n_real).clamp(min=1)
        row_weight = last_real(prompt.valid, rows)[:, 0]
        sums = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                              n - int(rows.max()), row_weight=row_weight)
        return gqa_reduce(sums, prompt.key.shape[1], self.gqa)

    def gumbel(self, prompt: LayerPrompt) -> Tensor:
        """Gumbel noise ``[B, H_kv, n]`` indexed by (head, index among real tokens)."""
        u = seeded_uniform(prompt, self.seed, torch.float64)
        return (-torch.log(-torch.log(u.clamp(1e-12, 1.0 - 1e-12)))).to(torch.float32)

    def split(self, kept: Tensor, n_real: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(sinks, protected recent, proxy top C_p, random C_r) per sample, [B] long each."""
        sinks = kept.clamp(max=self.sinks)
        protect = torch.minimum(resolve_share(self.protect, n_real), kept - sinks)
        rest = kept - sinks - protect
        rand = torch.minimum(resolve_share(float(self.random_share), kept), rest)
        return sinks, protect, rest - rand, rand

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool with exactly min(B, n_real) True per head."""
        check_prompt(prompt)
        b, hk, n = prompt.key.shape[:3]
        kept = budget.per_sample(prompt.n_real)
        if bool((kept >= prompt.n_real).all()):
            return keep_all(prompt)
        sinks, protect, top, _ = self.split(kept, prompt.n_real)
        forced = (first_real(prompt.valid, sinks) | last_real(prompt.valid, protect))
        forced = forced.expand(b, hk, n)
        f = self.scores(prompt, budget)
        deterministic = select_topk(f, sinks + protect + top, forced, prompt.valid)
        return select_topk(f + self.gumbel(prompt), kept, deterministic, prompt.valid)
