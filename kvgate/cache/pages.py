"""The pages a ragged base (``kvgate.cache.ragged``) holds its rows in.

A base of ``counts`` ``[S]`` entries per (sample, KV head) segment holds each segment's rows
from a page boundary on, ``page`` rows a page, so only a segment's last page is padded (rows
of zeros, position -1, held and counted like every row): heads that keep very different
numbers of tokens cost what they keep plus less than a page each, and attention reads each
head's pages where they lie (``kvgate.attention.paged``) instead of gathering the base into a
padded view every step. ``page_for`` chooses the page at each layout: one page per segment when
all hold alike (no padding: the base is a ``[B, H_kv, Tb, d]`` view), else the largest of
``PAGES`` whose padding stays within ``PAD_SHARE`` of the entries, else 1 (flat, no padding:
small or very uneven bases, and quantized ones, whose codes are gathered and dequantized into
the padded view each step anyway). Every function here takes the layout it works on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.cache.rows import PagedRows, PlainRows, QuantRows

# the page sizes (rows), largest first, and the padding a page size may add over the entries.
# Smaller pages pad less but make attention score more, smaller pieces; below the smallest,
# attention's per-page work costs more than gathering the base, so the base stays flat
PAGES = (64, 32, 16, 8)
PAD_SHARE = 1 / 64


def page_for(counts: Tensor, longest: int, uniform: bool, quantized: bool = False) -> int:
    """Rows per page for a base of ``counts`` ``[S]`` entries per segment (``longest`` the
    largest, ``uniform`` all equal), as the module docstring says."""
    if uniform:
        return max(longest, 1)
    if quantized:
        return 1
    sizes = torch.tensor(PAGES, device=counts.device)[:, None]
    padding = ((counts + sizes - 1).div(sizes, rounding_mode="floor") * sizes - counts).sum(-1)
    fits = (padding <= PAD_SHARE * counts.sum()).tolist()  # one read for every size
    return next((size for size, ok in zip(PAGES, fits) if ok), 1)


def segment_rows(counts: Tensor, page: int) -> Tensor:
    """``[S]`` rows each segment occupies: its entries rounded up to whole pages."""
    if page == 1:
        return counts
    return (counts + page - 1).div(page, rounding_mode="floor") * page


def first_rows(counts: Tensor, page: int) -> Tensor:
    """``[S]`` the row of each segment's first slot."""
    rows = segment_rows(counts, page)
    return rows.cumsum(0) - rows


def placed(rows: PlainRows | QuantRows, pos: Tensor, counts: Tensor, page: int, uniform: bool
           ) -> tuple[PlainRows | PagedRows | QuantRows, Tensor]:
    """A layout's entries given flat (segment-sorted, no padding: ``rows`` and int32 ``pos``),
    placed on their pages: each segment from its first row on, the padding rows zero with
    position -1; full-precision rows as ``PagedRows`` (each page's keys transposed, for
    ``kvgate.attention.paged``). As given when the layout has no padding."""
    if page == 1 or uniform:
        return rows, pos
    n = len(rows)
    seg = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                  output_size=n)
    shift = first_rows(counts, page) - (counts.cumsum(0) - counts)  # the padding before
    dst = torch.arange(n, device=counts.device) + shift[seg]
    total = int(segment_rows(counts, page).sum())
    out = rows.zeros(total)
    out.put_(dst, rows)
    out_pos = torch.full((total,), -1, dtype=torch.int32, device=counts.device)
    out_pos[dst] = pos
    return (PagedRows.of(out, page) if isinstance(out, PlainRows) else out), out_pos


def page_index(counts: Tensor, page: int, longest: int) -> tuple[Tensor, Tensor]:
    """``(seg, grid)`` ``[N]`` of a paged layout's ``N`` pages: each page's segment, and its
    place in the padded view's page grid, ``seg * ceil(longest / page)`` + its index in the
    segment (what ``kvgate.attention.paged.PagedKV`` reads)."""
    per = segment_rows(counts, page).div(page, rounding_mode="floor")  # [S] pages
    n = int(per.sum())
    seg = torch.repeat_interleave(torch.arange(per.shape[0], device=counts.device), per,
                                  output_size=n)
    index = torch.arange(n, device=counts.device) - (per.cumsum(0) - per)[seg]
    return seg, seg * -(-longest // page) + index


__all__ = ["PAD_SHARE", "PAGES", "first_rows", "page_for", "page_index", "placed",
           "segment_rows"]
