"""Toy policies written against kvgate.policies.base, with keep patterns a test can predict.

Every pattern depends only on (real position, KV head), never on the layer, so a reference
run of the plain model with one explicit 4-D mask per query head reproduces it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.policies.contract import (
    Budget,
    DecodeEvicting,
    EncodeMasking,
    LayerPrompt,
    Policy,
    StreamingPrefill,
)


def real_positions(valid: Tensor) -> Tensor:
    """[B, n] position among real tokens (-1 at padding)."""
    return (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)


def pattern(pos: Tensor, head: int, n_real: int) -> Tensor:
    """The toy eviction pattern for one KV head: bool, same shape as ``pos``.

    Head 0 drops every third token, head 1 keeps only the first 2 and the last 3, further
    heads drop odd positions. The first token (a sink) and the last are always kept.
    """
    last = pos == n_real - 1
    if head == 0:
        keep = pos % 3 != 1
    elif head == 1:
        keep = (pos < 2) | (pos >= n_real - 3)
    else:
        keep = pos % 2 == 0
    return (keep | last | (pos == 0)) & (pos >= 0)


class KeepAll(Policy):
    name = "keep_all"

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        return prompt.valid[:, None, :].expand(b, hk, n)


class PatternPolicy(Policy):
    """Prefill one-shot eviction with ``pattern``; ragged across heads and samples."""

    name = "pattern"

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        b, hk = prompt.key.shape[:2]
        pos = real_positions(prompt.valid)
        n_real = prompt.valid.sum(-1)
        rows = []
        for i in range(b):  # test helper, not a hot path
            rows.append(torch.stack([pattern(pos[i], h, int(n_real[i])) for h in range(hk)]))
        return torch.stack(rows)


class EncodePattern(PatternPolicy, EncodeMasking):
    """The same pattern, applied inside the prefill (Attention-Gate style, eq. 5)."""

    name = "encode_pattern"


class NewestPolicy(DecodeEvicting):
    """Decode-time eviction that keeps the sink and the newest entries up to capacity.

    Its ``tag`` statistic stores each slot's position + 1 so tests can check that per-slot
    statistics follow their entries through every rebuild (new slots arrive as 0).
    """

    name = "newest"

    def __init__(self) -> None:
        self.selects = 0
        self.prefill_rounds = 0

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        pos = real_positions(prompt.valid)
        kept = budget.per_sample(prompt.n_real)
        keep = (pos == 0) | (pos >= prompt.n_real[:, None] - (kept[:, None] - 1))
        return (keep & prompt.valid)[:, None, :].expand(b, hk, n)

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        b, hk, n = keep.shape
        pos = real_positions(prompt.valid).float() + 1
        return {"tag": pos[:, None, :].expand(b, hk, n).clone()}

    def decode_select(self, stats, logits, valid, positions, capacity, prefill=False):
        self.selects += 1
        self.prefill_rounds += int(prefill)
        tag = stats["tag"]
        old = tag > 0
        assert torch.equal(tag[old], positions[old].float() + 1), "stats lost alignment"
        tag = torch.where(valid & ~old, positions.float() + 1, tag)
        # rank by position (newest first), the sink always first
        score = positions.float().masked_fill(positions == 0, 1e9).masked_fill(~valid, -1e9)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
        return {"tag": tag}, (ranks < capacity[..., None]) & valid


class StreamNewest(NewestPolicy, StreamingPrefill):
    """Evict-while-encoding in blocks: the sink and the newest ``capacity - 1`` stay."""

    name = "stream_newest"

    def __init__(self, block: int = 3) -> None:
        super().__init__()
        self.block = block

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        return super().decode_init(prompt, keep)
