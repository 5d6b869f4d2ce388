"""Attention over a ragged store's pages: each KV head's kept entries read where they lie.

A ragged store (``kvgate.cache.ragged``) holds each (sample, KV head) segment's entries in
pages of ``P`` rows, a segment's pages one after another; heads that keep different numbers
of entries hold different numbers of pages. Attending over the padded slot view
``[B, H_kv, T, d]`` would first gather every entry into it (a copy of the whole base per
layer and step, T the longest segment). Here each page is scored against its own head's
query rows (one batched product over the pages, each page's keys held transposed,
``[d, P]``, so that the product reads them contiguously), the small logit rows are placed
into the padded slot view (``[B, H_kv, rows, T]``: the same layout, masks and logits as the
gather gives), and after the softmax each page's probabilities weight its own values, summed
per segment. The keys and values are read once, where they are stored.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PagedKV(NamedTuple):
    """One piece of the cache held in pages: keys ``[N_pages, d, P]``, each page transposed
    and contiguous (the ``q . k`` product reads it as it lies), values ``[N_pages, P, d]``;
    ``visible`` a bool mask over the padded slot view, 4-D and broadcastable to
    ``[B, H_kv, r, T]`` (required: it hides the padding of each segment's last page and the
    pages a shorter segment lacks); ``seg`` ``[N_pages]`` long: the segment ``b * H_kv + h``
    of each page; ``grid`` ``[N_pages]`` long: ``seg * ceil(T / P)`` + the page's index in its
    segment;
    ``slots``: ``T``, the slots of the padded view (the longest segment); ``kv_heads``:
    ``H_kv``."""

    keys: Tensor
    values: Tensor
    visible: Tensor
    seg: Tensor
    grid: Tensor
    slots: int
    kv_heads: int


def _pages_per_segment(part: PagedKV) -> int:
    return -(-part.slots // part.values.shape[1])


def paged_logits(q: Tensor, part: PagedKV) -> Tensor:
    """``q`` ``[B, H_kv, m, d]`` (a KV head's query rows, the GQA group folded in) against
    every page of its own segment: raw ``q . k`` logits ``[B, H_kv, m, T]`` in the padded
    slot view (0 at slots no page holds: ``visible`` hides them)."""
    b, hk, m, d = q.shape
    page = part.keys.shape[2]
    per = _pages_per_segment(part)
    # [N, m, P]: each page against its own segment's rows (the rows gathered, not the keys)
    s = torch.bmm(q.reshape(b * hk, m, d).index_select(0, part.seg), part.keys)
    grid = s.new_zeros(b * hk * per, m, page).index_copy_(0, part.grid, s)
    return grid.view(b * hk, per, m, page).transpose(1, 2).reshape(b, hk, m, per * page)[
        ..., :part.slots]


def paged_output(probs: Tensor, part: PagedKV) -> Tensor:
    """``probs`` ``[B, H_kv, m, T]`` over the padded slot view (0 where hidden) -> the
    weighted values ``[B, H_kv, m, d]``: each page's probabilities times its values, summed
    per segment."""
    b, hk, m, t = probs.shape
    _, page, d = part.values.shape
    per = _pages_per_segment(part)
    if per * page != t:
        probs = torch.nn.functional.pad(probs, (0, per * page - t))
    pages = probs.reshape(b * hk, m, per, page).transpose(1, 2).reshape(b * hk * per, m, page)
    out = torch.bmm(pages.index_select(0, part.grid), part.values)  # [N, m, d]
    return out.new_zeros(b * hk, m, d).index_add_(0, part.seg, out).view(b, hk, m, d)


__all__ = ["PagedKV", "paged_logits", "paged_output"]
