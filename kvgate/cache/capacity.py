"""The capacity each KV head is held at while decoding (decode-evicting policies)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.policies.contract import Budget, PolicyError


def check_decode_budget(value: Budget | float | None) -> float | None:
    """None, an int token count >= 1, or a ratio in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, Budget):
        return value.tokens if value.tokens is not None else float(value.ratio)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"decode_budget must be None, a token count or a ratio, got {value!r}")
    if isinstance(value, int) and value > 1:
        return value
    if 0.0 < float(value) <= 1.0:
        return float(value)
    raise PolicyError(f"decode_budget ratio must lie in (0, 1] (or give tokens > 1), got {value}")


def decode_capacity(decode_budget: float | None, counts: Tensor, n_real: Tensor) -> Tensor:
    """[B, H_kv] entries per head while decoding: the counts right after the prefill (None),
    a token count (int > 1) or a share of each sample's real prompt length (float)."""
    if decode_budget is None:
        return counts.clone()
    if isinstance(decode_budget, int):
        return torch.full_like(counts, decode_budget)
    per = torch.ceil(n_real.to(torch.float64) * decode_budget - 1e-9).long().clamp(min=1)
    return per[:, None].expand_as(counts).clone()
