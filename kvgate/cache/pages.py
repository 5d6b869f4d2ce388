"""The pages a ragged base (``kvgate.cache.ragged``) holds its rows in.

A base of ``counts`` ``[S]`` entries per (sample, KV head) segment holds each segment's rows
from a page boundary on, ``page`` rows a page, so only a segment's last page is padded (rows
of zeros, position -1, held and counted like every row): heads that keep very different
numbers of tokens cost what they keep plus less than a page each, and attention reads each
head's pages where they lie (``kvgate.attention.paged``) instead of gathering the base into a
padded view every step. ``page_for`` chooses the page at each layout:

- one page per segment when all hold alike (no padding: the base is a ``[B, H_kv, Tb, d]``
  view);
- one page per segment of the longest segment's rows when that pads within ``VIEW_SHARE`` of
  the entries (heads that keep nearly alike): the base is the padded view itself, read by one
  dense product as a uniform base is (on one CPU thread a decode step's attention over ~1,900
  entries a head took 0.72-0.74x the time of the same entries in pages of 64, whose many small
  products and per-page bookkeeping cost more than the padding they skip);
- for a base of at most ``ROW_SEGMENTS`` segments, 1: flat, no padding, attention scoring every
  segment's query rows against all the rows at once, other segments' hidden by a bias
  (``kvgate.attention.rows``);
- else the largest of ``PAGES`` whose padding stays within ``PAD_SHARE``, else 1 (flat: small or
  very uneven bases, gathered into the padded view each step).

Quantized bases are flat: their codes are dequantized each step anyway. Every function here
takes the layout it works on.
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
# the padding one page per segment (the padded view itself) may add over the entries
VIEW_SHARE = 1 / 64
# at most this many segments (one sample of a few KV heads), a ragged base is held flat and
# attended by rows (``kvgate.attention.rows``), which costs S times the products of pages:
# with S = 3 (400-2,100 entries a head) it took 0.63-0.86x the pages' time on one CPU thread;
# with more segments the S times outgrows the pages' bookkeeping
ROW_SEGMENTS = 4


def page_for(counts: Tensor, longest: int, uniform: bool, quantized: bool = False) -> int:
    """Rows per page for a base of ``counts`` ``[S]`` entries per segment (``longest`` the
    largest, ``uniform`` all equal), as the module docstring says."""
    if uniform:
        return max(longest, 1)
    if quantized:
        return 1
    # the longest segment first: one page per segment is the padded view itself; then flat
    # rows for few segments, else pages
    pages = () if counts.shape[0] <= ROW_SEGMENTS else PAGES
    candidates = (max(longest, 1), *pages)
    sizes = torch.tensor(candidates, device=counts.device)[:, None]
    shares = torch.tensor((VIEW_SHARE,) + (PAD_SHARE,) * len(pages), device=counts.device)
    padding = ((counts + sizes - 1).div(sizes, rounding_mode="floor") * sizes - counts).sum(-1)
    fits = padding <= shares * counts.sum()
    # one page each only when no segment is empty (an empty one would hold no page)
    fits[0] &= (counts > 0).all()
    fits = fits.tolist()  # one read for every size
    return next((size for size, ok in zip(candidates, fits) if ok), 1)


def segment_rows(counts: Tensor, page: int) -> Tensor:
    """``[S]`` rows each segment occupies: its entries rounded up to whole pages."""
    if page == 1:
        return counts
    return (counts + page - 1).div(page, rounding_mode="floor") * page


def first_rows(counts: Tensor, page: int) -> Tensor:
    """``[S]`` the row of each segment's first slot."""
    rows = segment_rows(counts, page)
    return rows.cumsum(0) - rows


def one_page_each(page: int, longest: int, uniform: bool) -> bool:
    """Whether a ragged layout holds one page per segment, as long as the longest: its rows are
    then the padded slot view ``[B, H_kv, Tb, d]`` itself (not ``PagedRows``)."""
    return not uniform and 1 < page == longest


def placed(rows: PlainRows | QuantRows, pos: Tensor, counts: Tensor, page: int, uniform: bool,
           longest: int) -> tuple[PlainRows | PagedRows | QuantRows, Tensor]:
    """A layout's entries given flat (segment-sorted, no padding: ``rows`` and int32 ``pos``),
    placed on their pages: each segment from its first row on, the padding rows zero with
    position -1; full-precision rows as ``PagedRows`` (each page's keys transposed, for
    ``kvgate.attention.paged``) unless there is one page per segment (``one_page_each``). As
    given when the layout has no padding."""
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
    if isinstance(out, PlainRows) and not one_page_each(page, longest, uniform):
        out = PagedRows.of(out, page)
    return out, out_pos


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


__all__ = ["PAD_SHARE", "PAGES", "ROW_SEGMENTS", "VIEW_SHARE", "first_rows", "one_page_each", "page_for", "page_index",
           "placed", "segment_rows"]
