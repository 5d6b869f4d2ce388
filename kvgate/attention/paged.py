"""Attention over a ragged store's pages: each KV head's kept entries read where they lie.

A ragged store (``kvgate.cache.ragged``) holds each (sample, KV head) segment's entries in
pages of ``P`` rows, a segment's pages one after another; heads that keep different numbers
of entries hold different numbers of pages. Attending over the padded slot view
``[B, H_kv, T, d]`` would first gather every entry into it (a copy of the whole base per
layer and step, T the longest segment). Here each page is scored against its own head's
query rows (one batched product over the pages, each page's keys held transposed,
``[d, P]``, so that the product reads them contiguously) and the scores are written straight
into the caller's logits buffer, laid out as the padded page grid (``[B, H_kv, rows,
ceil(T / P) * P]``: the slot view, plus the padding of the longest segment's last page);
after the softmax each page's probabilities weight its own values, summed per segment. The
keys and values are read once, where they are stored. Given ``bias`` (the store's own
visibility in page layout), the product adds it and the scale in one call (``baddbmm``), so
a decode step spends no separate pass over the logits on masking.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class PagedKV(NamedTuple):
    """One piece of the cache held in pages: keys ``[N_pages, d, P]``, each page transposed
    and contiguous (the ``q . k`` product reads it as it lies), values ``[N_pages, P, d]``;
    ``visible`` a bool mask over the padded slot view, 4-D and broadcastable to
    ``[B, H_kv, r, T]`` (it hides the padding of each segment's last page; slots no page holds
    are hidden anyway); ``seg`` ``[N_pages]`` long: the segment ``b * H_kv + h`` of each page;
    ``index`` ``[N_pages]`` long: the page's index within its segment; ``slots``: ``T``, the
    slots of the padded view (the longest segment); ``kv_heads``: ``H_kv``; ``bias``
    (optional) ``[N_pages, 1, P]`` float32, 0 where a row is read and -inf where not: the
    same as ``visible`` in page layout, which is then not applied again."""

    keys: Tensor
    values: Tensor
    visible: Tensor
    seg: Tensor
    index: Tensor
    slots: int
    kv_heads: int
    bias: Tensor | None = None


def paged_width(part: PagedKV) -> int:
    """Columns of the page grid: ``ceil(slots / P) * P``."""
    page = part.values.shape[1]
    return -(-part.slots // page) * page


def _grid(x: Tensor, page: int) -> Tensor:
    """``[B, H_kv, m, W]`` (any strides with a unit last one) as the page grid
    ``[B * H_kv, W / P, m, P]``, a view: page ``(seg, index)`` is ``grid[seg, index]``."""
    b, hk, m, w = x.shape
    return x.view(b * hk, m, w // page, page).permute(0, 2, 1, 3)


def paged_logits(q: Tensor, part: PagedKV, scaling: float, out: Tensor) -> None:
    """``q`` ``[B, H_kv, m, d]`` (a KV head's query rows, the GQA group folded in) against
    every page of its own segment, written into ``out`` ``[B, H_kv, m, paged_width]`` (float32,
    a view into the caller's logits): the scaled ``q . k`` logits, ``-inf`` at slots no page
    holds and, when ``bias`` is given, where it hides a row."""
    b, hk, m, d = q.shape
    rows = q.reshape(b * hk, m, d).index_select(0, part.seg)  # the rows gathered, not the keys
    if part.bias is not None and rows.dtype == torch.float32:  # mask and scale in the product
        s = torch.baddbmm(part.bias, rows, part.keys, alpha=scaling)  # [N, m, P]
    else:
        s = torch.bmm(rows, part.keys).float().mul_(scaling)
        if part.bias is not None:
            s.add_(part.bias)
    out.fill_(-math.inf)
    _grid(out, part.keys.shape[2]).index_put_((part.seg, part.index), s)


def paged_output(probs: Tensor, part: PagedKV) -> Tensor:
    """``probs`` ``[B, H_kv, m, paged_width]`` over the page grid (0 where hidden) -> the
    weighted values ``[B, H_kv, m, d]``: each page's probabilities times its values, summed
    per segment."""
    b, hk, m, _ = probs.shape
    d = part.values.shape[2]
    pages = _grid(probs, part.values.shape[1])[part.seg, part.index]  # [N, m, P]
    out = torch.bmm(pages, part.values)  # [N, m, d]
    return out.new_zeros(b * hk, m, d).index_add_(0, part.seg, out).view(b, hk, m, d)


__all__ = ["PagedKV", "paged_logits", "paged_output", "paged_width"]
