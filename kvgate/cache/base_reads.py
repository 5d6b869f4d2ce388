"""How attention reads a ``RaggedStore``'s base (``kvgate.cache.ragged``), in each layout
``kvgate.cache.pages`` chooses: a uniform or ``padded`` base as the ``[B, H_kv, Tb, d]`` view it
is, a ``paged`` one in its pages (``kvgate.attention.paged``), a ``flat`` one of few segments
by rows (``by_rows``: ``kvgate.attention.rows``), any other flat one gathered into the padded
view. ``BaseReads`` is the store's reading half, kept apart from its writing (appends,
compactions, holes): it reads the store's layout (``rows``, ``counts``, ``page``, ``holes``,
``_base_len``, ``_uniform``, ``_views``, ``_base_index``) and writes only its per-layout views.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.cache import pages as layouts
from kvgate.cache.pages import one_page_each, page_index
from kvgate.cache.rows import PlainRows


class BaseReads:
    """The layout a ``RaggedStore``'s base is held in, and the base as attention reads it."""

    @property
    def paged(self) -> bool:
        """A ragged base in pages, which attention reads as they are (``pages``)."""
        return not self._uniform and self.page > 1 and not self.padded

    @property
    def flat(self) -> bool:
        """A ragged base held flat (page 1, no padding): its rows have no padded view but the
        gathered one, or attention reads them by rows (``row_bias``)."""
        return not self._uniform and self.page == 1

    @property
    def by_rows(self) -> bool:
        """A ``flat`` base of few segments (``ROW_SEGMENTS``), which attention reads by rows
        (``rows_part``) rather than gathered into the padded view."""
        return self.flat and self.batch * self.kv_heads <= layouts.ROW_SEGMENTS

    @property
    def padded(self) -> bool:
        """A ragged base held as its padded view, one page per segment (``kvgate.cache.pages``):
        ``base_kv`` gives a view of it, as of a uniform base."""
        return one_page_each(self.page, self._base_len, self._uniform)

    def base_kv(self) -> tuple[Tensor, Tensor]:
        """Base keys/values as ``[B, H_kv, Tb, d]``: a view when uniform or held padded, else a
        padded gather."""
        shape = (self.batch, self.kv_heads, self._base_len, self.head_dim)
        idx = None if self._uniform or self.padded else self._base_index().view(-1)
        if idx is not None and not isinstance(self.rows, PlainRows):  # codes or paged keys
            # gathered by rows (codes then dequantized; page-transposed keys through a view)
            keys, values = self.rows.take(idx).dense()
            return keys.view(shape), values.view(shape)
        keys, values = self.rows.dense()  # dequantized each call when quantized: no copy kept
        if idx is None:
            return keys.view(shape), values.view(shape)
        # index_select: several times faster than keys[idx]
        return keys.index_select(0, idx).view(shape), values.index_select(0, idx).view(shape)

    def pages(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The base as it is held, in pages (``paged`` stores): keys ``[N, d, page]``, each
        page transposed, and values ``[N, page, d]`` (``PagedRows.pages``), the segment of
        each page ``[N]`` and its place in the padded view's page grid ``[N]``
        (``segment * ceil(Tb / page)`` + its index in the segment): what
        ``kvgate.attention.paged.PagedKV`` reads."""
        if "page_seg" not in self._views:
            self._views["page_seg"], self._views["page_grid"] = page_index(
                self.counts, self.page, self._base_len)
        keys, values = self.rows.pages()  # a paged base is always PagedRows (``fill``)
        return keys, values, self._views["page_seg"], self._views["page_grid"]

    def rows_part(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A ``flat`` base as held, for ``kvgate.attention.rows.RowKV``: keys and values
        ``[R, d]`` (dequantized when quantized), ``row_bias`` and the row of each slot
        ``[S, Tb]``."""
        keys, values = self.rows.dense()
        return keys, values, self.row_bias(), self._base_index()

    def row_bias(self) -> Tensor:
        """``[S, 1, R]`` fp32 of a ``flat`` base: 0 where segment ``s`` may read row ``r`` (its
        own, not a hole), -inf elsewhere (``kvgate.attention.rows``); kept per layout and
        holes, like ``visible_base``."""
        bias = self._views.get("row_bias")
        if bias is None:
            segs = self.batch * self.kv_heads
            ar = torch.arange(segs, device=self.device)
            owner = torch.repeat_interleave(ar, self.counts, output_size=len(self.rows))
            mine = owner[None, :] == ar[:, None]  # [S, R]
            if self.holes is not None:  # a hole's slot -> its row, read by no one
                base = self.holes[..., :self._base_len].reshape(segs, -1)
                seg, slot = base.nonzero(as_tuple=True)
                mine[seg, self._base_index()[seg, slot]] = False
            bias = torch.zeros(segs, 1, mine.shape[1], device=self.device)
            bias = self._views["row_bias"] = bias.masked_fill_(~mine[:, None, :], float("-inf"))
        return bias


__all__ = ["BaseReads"]
