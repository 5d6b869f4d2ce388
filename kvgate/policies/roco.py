"""RoCo, Robust Cache Omission (EasyKV policy ``roco``).

Paper: "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language Model
Inference", Ren and Zhu 2024, arXiv:2402.06262 (code: EasyKV). Rule: an entry's importance is
the *mean* attention it has received (not the sum, which favours old entries), and only the
entries whose attention varied least (lowest standard deviation) may be evicted, so a briefly
important entry is not thrown out; the least important of those goes first.

Three running sums per (layer, KV head, cached entry), with the attention a_ij averaged over
the GQA group: ``acc = sum a``, ``acc2 = sum a^2``, ``cnt = rows that saw the entry``.

- importance = mean attention score ``MAS = acc / cnt`` (a mean, not H2O's sum);
- robustness = ``std = sqrt(acc2 / cnt - MAS^2)``;
- eviction scope = the ``scope`` lowest-std entries, never the sinks (first ``sinks``) or the
  last ``protect_last`` entries (a new entry has std 0 and would otherwise be evicted at once);
  ``scope = capacity - floor(ratio * capacity) - sinks`` (at least the number to evict), with
  ``ratio = recent_ratio`` (0.1) while encoding and ``decode_recent_ratio`` (0.3) while decoding;
- evict the lowest MAS inside the scope (scope filter first, then the argmin).

RoCo evicts while encoding (``StreamingPrefill``): the prompt goes through in blocks of
``block`` rows and the cache is cut back to capacity after each block. The one-shot ``keep``
simulates exactly that on the layer's q/k (every block's rows see only the entries still held),
a fallback approximation of the streamed prefill since later layers' inputs are not
recomputed. Blocks are aligned to the end of the prompt so a left-padded sample is processed
like the same sample alone; the prefix attention is accumulated (EasyKV ``keep_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    StreamingPrefill,
    attention_sums,
    by_position,
    check_decode,
    check_int,
    check_prompt,
    decode_probs,
    keep_all,
    option_error,
    real_index,
    select_topk,
    stat,
)


def mas_std(acc: Tensor, acc2: Tensor, cnt: Tensor) -> tuple[Tensor, Tensor]:
    """Mean attention score and its (population) standard deviation, shapes as the inputs."""
    count = cnt.clamp(min=1.0)
    mas = acc / count
    return mas, (acc2 / count - mas.square()).clamp(min=0.0).sqrt()


def roco_keep(mas: Tensor, std: Tensor, valid: Tensor, protected: Tensor, scope: Tensor,
              capacity: Tensor) -> Tensor:
    """Which entries stay after evicting down to ``capacity``.

    mas, std [B, Hk, T] float; valid, protected [B, Hk, T] bool; scope, capacity [B, Hk] long.
    The scope is the ``scope`` lowest-std unprotected entries (widened to the number of
    evictions); the lowest-MAS scope members go first. Only if the unprotected entries cannot
    cover the evictions are others evicted (again by lowest MAS). Returns [B, Hk, T] bool with
    min(capacity, valid count) True.
    """
    free = valid & ~protected
    n_evict = (valid.sum(-1) - capacity).clamp(min=0)
    scope = torch.minimum(torch.maximum(scope, n_evict), free.sum(-1))
    in_scope = select_topk(-std, scope, None, free)
    # tiers: in scope (0) < unprotected (1) < protected (2); MAS in [0, 1] orders each tier
    tier = torch.where(in_scope, 0.0, torch.where(free, 1.0, 2.0))
    return select_topk(tier * 4.0 + mas.float(), capacity, None, valid)


@dataclass
class RoCo(StreamingPrefill):
    """Evict-while-encoding (blocks) and decode-time eviction by MAS inside a std scope."""

    sinks: int = 4
    protect_last: int = 10
    recent_ratio: float = 0.1
    decode_recent_ratio: float = 0.3
    block: int = 8

    name = "roco"
    needs_attention = True

    def __post_init__(self) -> None:
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "protect_last", self.protect_last, 0)
        check_int(self.name, "block", self.block, 1)
        for option in ("recent_ratio", "decode_recent_ratio"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value < 1.0:
                raise option_error(self.name, option, "must lie in [0, 1)", value)

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Accumulate the r new rows, then evict to ``capacity``. ``prefill=True`` while the
        prompt is streamed (encoding ratio and sinks as in EasyKV's encoding mode)."""
        check_decode(logits, valid, positions, capacity)
        b, h, r, t = logits.shape
        hk = valid.shape[1]
        a = decode_probs(logits).view(b, hk, h // hk, r, t).mean(2)
        seen = torch.isfinite(logits).view(b, hk, h // hk, r, t).any(2)
        acc = (stat(stats, "acc", valid) + a.sum(2)).masked_fill(~valid, 0.0)
        acc2 = (stat(stats, "acc2", valid) + a.square().sum(2)).masked_fill(~valid, 0.0)
        cnt = (stat(stats, "cnt", valid) + seen.sum(2)).masked_fill(~valid, 0.0)
        mas, std = mas_std(acc, acc2, cnt)
        sinks = torch.full_like(capacity, self.sinks)
        protected = (by_position(positions, valid, sinks, newest=False)
                     | by_position(positions, valid, torch.full_like(capacity, self.protect_last),
                                   newest=True))
        ratio = self.recent_ratio if prefill else self.decode_recent_ratio
        kept_out = torch.floor(capacity.double() * ratio + 1e-9).long()
        scope = (capacity - kept_out - sinks).clamp(min=0)
        keep = roco_keep(mas, std, valid, protected, scope, capacity)
        return {"acc": acc, "acc2": acc2, "cnt": cnt}, keep

    def simulate(self, prompt: LayerPrompt, kept: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """Stream the prompt in blocks, evicting to ``kept`` ([B] long) after each block.

        Returns the running stats ([B, H_kv, n] each) and the final keep mask [B, H_kv, n]."""
        q, k, valid = prompt.query, prompt.key, prompt.valid
        b, h, n, _ = q.shape
        hk = k.shape[1]
        keys = k.float().repeat_interleave(h // hk, dim=1)
        cols = torch.arange(n, device=q.device)
        positions = real_index(valid)[:, None, :].expand(b, hk, n)
        capacity = kept[:, None].expand(b, hk)
        held = torch.zeros((b, hk, n), dtype=torch.bool, device=q.device)
        stats: dict[str, Tensor] = {}
        first_end = n - (math.ceil(n / self.block) - 1) * self.block
        for end in range(first_end, n + 1, self.block):
            rows = torch.arange(max(0, end - self.block), end, device=q.device)
            arrived = valid & (cols >= rows[0]) & (cols < end)
            held = held | arrived[:, None, :]
            logits = torch.matmul(q[:, :, rows].float(), keys.transpose(-1, -2)) * prompt.scaling
            visible = (held.repeat_interleave(h // hk, dim=1)[:, :, None, :]
                       & (cols[None, :] <= rows[:, None])[None, None]
                       & valid[:, None, rows, None])
            logits = logits.masked_fill(~visible, -math.inf)
            stats, held = self.decode_select(stats, logits, held, positions, capacity,
                                             prefill=True)
        return stats, held

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool: the block-streamed eviction simulated on this layer."""
        check_prompt(prompt)
        kept = budget.per_sample(prompt.n_real)
        if bool((kept >= prompt.n_real).all()):
            return keep_all(prompt)
        return self.simulate(prompt, kept)[1]

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        """acc / acc2 / cnt over the prompt ([B, H_kv, n]) as left by the streamed eviction
        that produced ``keep`` (its per-head count is the budget)."""
        check_prompt(prompt)
        kept = keep[:, 0].sum(-1).clamp(min=1)
        if bool((kept >= prompt.n_real).all()):  # nothing was evicted: no need to stream
            return self.unevicted_stats(prompt)
        return self.simulate(prompt, kept)[0]

    def unevicted_stats(self, prompt: LayerPrompt) -> dict[str, Tensor]:
        """What ``simulate`` accumulates when nothing is evicted, in one chunked pass: every
        real row's group-mean attention over every real entry up to it (the prompt's head in
        the streamed prefill, before the budget is reached: half of RoCo's prefill at 50%)."""
        acc, acc2 = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                                   squares=True, lse=prompt.lse, group_mean=True)
        real = prompt.valid.float()
        later_rows = real.flip(-1).cumsum(-1).flip(-1)  # real rows at or after each entry
        cnt = (later_rows * real)[:, None, :].expand_as(acc).contiguous()
        return {"acc": acc, "acc2": acc2, "cnt": cnt}
