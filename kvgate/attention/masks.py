"""Mask helpers every layer above shares: real tokens, first / last real tokens, visibility.

Left padding is the one batching convention in kvgate: a row's real tokens are a suffix of it.
Everything here reads masks in that convention and never depends on how much padding a row has,
so a padded sample computes what it computes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from kvgate.errors import KVGateError


class MaskError(KVGateError, RuntimeError):
    """An attention mask whose shape does not fit the tokens it should describe."""


T = TypeVar("T")


def memoised(memo: dict | None, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, kept in ``memo`` under ``key`` (a dict that lives as long as the mask its
    values derive from: one forward of the model); computed afresh when ``memo`` is None."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Token ids of a batch, right-aligned: ``(ids [B, n], attention_mask [B, n])`` long."""
    return _pad(rows, pad, left=True)


def right_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Token ids of a batch, left-aligned: ``(ids [B, n], attention_mask [B, n])`` long."""
    return _pad(rows, pad, left=False)


def _pad(rows: Sequence[Sequence[int]], pad: int, left: bool) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # one copy per sequence, not per token
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span] = torch.tensor(list(r), dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def as_bool(mask: Tensor) -> Tensor:
    """A boolean visibility mask from a bool or an additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    # additive float masks: 0 where visible, a very negative number where hidden
    return mask > torch.finfo(mask.dtype).min / 2


def new_token_validity(mask: Tensor | None, batch: int, rows: int, device) -> Tensor:
    """Which of the ``rows`` new tokens are real (not padding): ``[B, rows]`` bool.

    The new tokens are the last ``rows`` key columns of the mask, so a real token is one that
    sees itself (the diagonal); this holds for causal, padded and sliding-window masks alike.
    """
    if mask is None:
        return torch.ones(batch, rows, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # a raw [B, kv] padding mask
        return as_bool(mask[:, -rows:]).expand(batch, rows).to(device)
    if mask.dim() != 4 or mask.shape[-2] != rows or mask.shape[-1] < rows:
        raise MaskError(f"attention mask of shape {tuple(mask.shape)} does not fit {rows} new "
                        "tokens; expected transformers' 4-D [B, 1, q, kv] mask")
    j = torch.arange(rows, device=mask.device)
    diag = mask[:, 0, j, mask.shape[-1] - rows + j]
    return as_bool(diag).expand(batch, rows).to(device)


def positions_after(valid: Tensor, start: Tensor) -> Tensor:
    """True positions of new tokens: ``start`` [B] + running count of real tokens, -1 at pads."""
    pos = start[:, None] + valid.long().cumsum(-1) - 1
    return pos.masked_fill(~valid, -1)


def prompt_allowed(mask: Tensor | None, batch: int, n: int, window: int | None,
                   device) -> Tensor:
    """``[B, n, n]`` bool: which key each prompt row may see before any eviction.

    Taken from the model's mask when there is one (causal + padding + sliding window);
    rebuilt as causal (+ window) when transformers skipped the mask.
    """
    if mask is not None:
        if mask.dim() != 4 or mask.shape[-2:] != (n, n):
            raise MaskError(f"prefill attention mask of shape {tuple(mask.shape)} is not "
                            f"[B, 1, {n}, {n}]")
        return as_bool(mask[:, 0]).expand(batch, n, n)
    qi = torch.arange(n, device=device)[:, None]
    ki = torch.arange(n, device=device)[None, :]
    allowed = ki <= qi
    if window:
        allowed = allowed & (ki > qi - window)
    return allowed[None].expand(batch, n, n)


def real_index(valid: Tensor) -> Tensor:
    """Index of each token among the real tokens of its row (``[B, n]`` long; pads before the
    first real token get -1). Makes sinks independent of how much left padding a row has."""
    return valid.long().cumsum(-1) - 1


def first_real(valid: Tensor, count: Tensor) -> Tensor:
    """The first ``count`` real tokens: valid [B, n], count [B] or [B, Hk] -> [B, 1|Hk, n]."""
    count = count.view(valid.shape[0], -1, 1)
    return valid[:, None, :] & (real_index(valid)[:, None, :] < count)


def last_real(valid: Tensor, count: Tensor) -> Tensor:
    """The last ``count`` real tokens: valid [B, n], count [B] or [B, Hk] -> [B, 1|Hk, n]."""
    count = count.view(valid.shape[0], -1, 1)
    n_real = valid.sum(-1).view(-1, 1, 1)
    return valid[:, None, :] & (real_index(valid)[:, None, :] >= n_real - count)
