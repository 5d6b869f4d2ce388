"""Attention over a ragged store's flat rows: every query row against every row, the rows of
other segments hidden by a bias.

A ragged base held flat (``kvgate.cache.ragged``, page 1: keys / values ``[R, d]``, each
(sample, KV head) segment's rows one after another, no padding) has no ``[B, H_kv, Tb, d]``
view; the pages (``kvgate.attention.paged``) and the padded gather both pay per step for
placing the rows into one. Here all the query rows of every segment (``[S * m, d]``) are
scored against all ``R`` rows in one product, an additive bias ``[S, 1, R]`` (0 at a
segment's own visible rows, -inf elsewhere) leaves each segment its own, and the
probabilities weight the values in one more product. That is ``S`` times the arithmetic of
scoring each segment alone, but two large products instead of many small ones and no
bookkeeping between them: with one sample of 3 KV heads (S = 3) and 400-2,100 entries a head
it took 0.63-0.86x the time of the pages on one CPU thread. The store uses it only for few
segments (``kvgate.cache.pages.ROW_SEGMENTS``), where the ``S`` times pays.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RowKV(NamedTuple):
    """A flat base: keys / values ``[R, d]``; ``bias`` ``[S, 1, R]`` fp32 (0 where segment
    ``s = b * H_kv + h`` may read row ``r``, -inf elsewhere, holes included); ``index``
    ``[S, Tb]`` the row of each slot of the padded view (any row at empty slots) and
    ``visible`` ``[B, H_kv, 1, Tb]`` its real slots: how logits go back to the slot view;
    ``slots``: ``Tb``; ``kv_heads``: ``H_kv``."""

    keys: Tensor
    values: Tensor
    bias: Tensor
    index: Tensor
    visible: Tensor
    slots: int
    kv_heads: int


def row_logits(q: Tensor, part: RowKV, scaling: float) -> Tensor:
    """``q`` ``[B, H_kv, m, d]`` -> scaled fp32 logits ``[B, H_kv, m, R]`` over every row,
    -inf at rows of other segments and hidden ones."""
    b, hk, m, d = q.shape
    s = torch.mm(q.reshape(b * hk * m, d), part.keys.t()).view(b * hk, m, -1)
    s = (s if s.dtype == torch.float32 else s.float()).mul_(scaling).add_(part.bias)
    return s.view(b, hk, m, -1)


def row_output(probs: Tensor, part: RowKV) -> Tensor:
    """``probs`` ``[B, H_kv, m, R]`` (0 at other segments' rows) -> ``[B, H_kv, m, d]``."""
    b, hk, m, r = probs.shape
    return torch.mm(probs.reshape(b * hk * m, r), part.values).view(b, hk, m, -1)


def slot_logits(logits: Tensor, part: RowKV) -> Tensor:
    """Row logits ``[B, H, r, R]`` (the GQA group unfolded) -> the slot view
    ``[B, H, r, Tb]``, -inf at empty slots: what the padded layouts give."""
    b, h, r, _ = logits.shape
    hk = part.kv_heads
    idx = part.index.view(b, hk, 1, 1, -1).expand(b, hk, h // hk, r, -1)
    out = logits.view(b, hk, h // hk, r, -1).gather(-1, idx)
    return out.masked_fill(~part.visible.unsqueeze(2), float("-inf")).view(b, h, r, -1)


__all__ = ["RowKV", "row_logits", "row_output", "slot_logits"]
