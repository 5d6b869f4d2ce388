"""The rows a ``RaggedStore`` base holds: keys and values ``[R, d]``, full precision
(``PlainRows``), full precision on pages with each page's keys transposed (``PagedRows``) or
quantized (``QuantRows``), behind one small interface the store moves rows with (``take``,
``put_``, ``empty``, ``zeros``, ``cat``, ``clone``) and attention reads (``dense``). The store
decides which row holds which entry (and which rows pad a page).

``QuantRows`` keeps every row's codes (``kvgate.cache.quant``) and, for the rows still inside
the residual window, their exact keys and values besides (``exact`` row indices, ``exact_k`` /
``exact_v``): ``dense`` writes those over the dequantized rows, so a recent entry reads back
bit-equal to what the model gave; ``aged`` drops the exact copy of every row that left the
window (its codes stay). Every operation is a gather or scatter over all rows at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.cache.quant import KVQuant, Packed, dequantize, quantize


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PlainRows:
    """Keys and values ``[E, d]`` as the model gave them."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys, self.values = keys, values

    def __len__(self) -> int:
        return self.keys.shape[0]

    def take(self, idx: Tensor) -> PlainRows:
        return PlainRows(self.keys[idx], self.values[idx])

    def put_(self, idx: Tensor, rows: PlainRows) -> None:
        self.keys[idx], self.values[idx] = rows.keys, rows.values

    def empty(self, n: int) -> PlainRows:
        return PlainRows(self.keys.new_empty(n, self.keys.shape[1]),
                         self.values.new_empty(n, self.values.shape[1]))

    def zeros(self, n: int) -> PlainRows:
        return PlainRows(self.keys.new_zeros(n, self.keys.shape[1]),
                         self.values.new_zeros(n, self.values.shape[1]))

    def clone(self) -> PlainRows:
        return PlainRows(self.keys.clone(), self.values.clone())

    def aged(self, recent: Tensor) -> PlainRows:
        return self

    def dense(self) -> tuple[Tensor, Tensor]:
        return self.keys, self.values

    def tensors(self) -> list[Tensor]:
        return [self.keys, self.values]

    def nbytes(self) -> int:
        return _nbytes(*self.tensors())

    @staticmethod
    def cat(parts: list[PlainRows]) -> PlainRows:
        return PlainRows(torch.cat([p.keys for p in parts]), torch.cat([p.values for p in parts]))


class PagedRows:
    """Full-precision rows ``[N * P, d]`` on ``N`` pages of ``P``, the keys held page by page
    transposed: ``keys_t`` ``[N, d, P]`` contiguous (row ``r`` is column ``r % P`` of page
    ``r // P``), ``values`` ``[N * P, d]``. Scoring a page is then a product with a contiguous
    ``[d, P]`` matrix: on one CPU thread, 99 pages of 64 rows (d = 64) against 3 query rows
    each took 1.7-3.5x less time than against the transposed view of ``[P, d]`` rows. Each
    key is held once: ``take`` and ``put_`` read and write rows through the strided
    ``[N, P, d]`` view.

    New rows (``empty``, ``zeros``, ``take``) are flat ``PlainRows``: a base is built flat and
    goes onto pages only when placed (``kvgate.cache.pages.placed``, by ``of``); stores are
    concatenated flat too (``RaggedStore.packed``), so there is no ``cat``."""

    __slots__ = ("keys_t", "values")

    def __init__(self, keys_t: Tensor, values: Tensor) -> None:
        self.keys_t, self.values = keys_t, values

    @classmethod
    def of(cls, rows: PlainRows, page: int) -> PagedRows:
        """``rows`` ``[N * P, d]`` on pages of ``page``: the keys transposed per page (a
        transient copy: the flat keys are dropped)."""
        n, d = rows.keys.shape
        keys_t = rows.keys.view(n // page, page, d).transpose(1, 2).contiguous()
        return cls(keys_t, rows.values)

    def __len__(self) -> int:
        return self.values.shape[0]

    def _cells(self, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The ``[N, P, d]`` view of the keys (no copy), and rows ``idx``'s page and column."""
        page = self.keys_t.shape[2]
        return (self.keys_t.transpose(1, 2), idx.div(page, rounding_mode="floor"),
                idx.remainder(page))

    def take(self, idx: Tensor) -> PlainRows:
        view, page, col = self._cells(idx)
        return PlainRows(view[page, col], self.values.index_select(0, idx))

    def put_(self, idx: Tensor, rows: PlainRows) -> None:
        view, page, col = self._cells(idx)
        view[page, col], self.values[idx] = rows.keys, rows.values

    def empty(self, n: int) -> PlainRows:
        return PlainRows(self.values.new_empty(n, self.keys_t.shape[1]),
                         self.values.new_empty(n, self.values.shape[1]))

    def zeros(self, n: int) -> PlainRows:
        return PlainRows(self.values.new_zeros(n, self.keys_t.shape[1]),
                         self.values.new_zeros(n, self.values.shape[1]))

    def clone(self) -> PagedRows:
        return PagedRows(self.keys_t.clone(), self.values.clone())

    def aged(self, recent: Tensor) -> PagedRows:
        return self

    def dense(self) -> tuple[Tensor, Tensor]:
        """Keys and values ``[N * P, d]``; the keys a copy, back in rows."""
        return self.keys_t.transpose(1, 2).reshape(len(self), self.keys_t.shape[1]), self.values

    def pages(self) -> tuple[Tensor, Tensor]:
        """Keys ``[N, d, P]`` and values ``[N, P, d]``, as held (views)."""
        n, _, page = self.keys_t.shape
        return self.keys_t, self.values.view(n, page, self.values.shape[1])

    def tensors(self) -> list[Tensor]:
        return [self.keys_t, self.values]

    def nbytes(self) -> int:
        return _nbytes(*self.tensors())


class QuantRows:
    """Keys and values as codes (``k``, ``v``: ``Packed``), plus exact copies of the rows in the
    residual window (``exact`` ``[m]`` long row indices, ``exact_k`` / ``exact_v`` ``[m, d]``)."""

    __slots__ = ("dtype", "exact", "exact_k", "exact_v", "k", "v")

    def __init__(self, k: Packed, v: Packed, exact: Tensor, exact_k: Tensor, exact_v: Tensor,
                 dtype: torch.dtype) -> None:
        self.k, self.v, self.dtype = k, v, dtype
        self.exact, self.exact_k, self.exact_v = exact, exact_k, exact_v

    @classmethod
    def encode(cls, keys: Tensor, values: Tensor, kv: KVQuant) -> QuantRows:
        """Rows ``[n, d]`` quantized, every one also held exact (``aged`` drops the old ones)."""
        group = kv.group_for(keys.shape[1])
        exact = torch.arange(keys.shape[0], device=keys.device)
        return cls(quantize(keys, kv.bits, group), quantize(values, kv.bits, group), exact,
                   keys, values, keys.dtype)

    def __len__(self) -> int:
        return len(self.k)

    def _exact_at(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """For rows ``idx`` of self: (positions in ``idx`` of exact rows, their exact slots)."""
        slot = torch.full((len(self),), -1, dtype=torch.long, device=idx.device)
        slot[self.exact] = torch.arange(self.exact.shape[0], device=idx.device)
        at = slot[idx]
        where = (at >= 0).nonzero().view(-1)
        return where, at[where]

    def take(self, idx: Tensor) -> QuantRows:
        where, slots = self._exact_at(idx)
        return QuantRows(self.k.take(idx), self.v.take(idx), where, self.exact_k[slots],
                         self.exact_v[slots], self.dtype)

    def put_(self, idx: Tensor, rows: QuantRows) -> None:
        """Rows ``idx`` of self become ``rows`` (codes and exact copies), in place."""
        self.k.put_(idx, rows.k)
        self.v.put_(idx, rows.v)
        stay = ~torch.isin(self.exact, idx)  # exact copies of overwritten rows go
        self.exact = torch.cat([self.exact[stay], idx[rows.exact]])
        self.exact_k = torch.cat([self.exact_k[stay], rows.exact_k])
        self.exact_v = torch.cat([self.exact_v[stay], rows.exact_v])

    def empty(self, n: int) -> QuantRows:
        return QuantRows(self.k.empty(n), self.v.empty(n), self.exact[:0].clone(),
                         self.exact_k[:0].clone(), self.exact_v[:0].clone(), self.dtype)

    def zeros(self, n: int) -> QuantRows:
        """``n`` rows that read back as 0, none held exact (a page's padding)."""
        return QuantRows(self.k.zeros(n), self.v.zeros(n), self.exact[:0].clone(),
                         self.exact_k[:0].clone(), self.exact_v[:0].clone(), self.dtype)

    def clone(self) -> QuantRows:
        return QuantRows(self.k.clone(), self.v.clone(), self.exact.clone(),
                         self.exact_k.clone(), self.exact_v.clone(), self.dtype)

    def aged(self, recent: Tensor) -> QuantRows:
        """Exact copies kept only for rows where ``recent`` ``[E]`` is True."""
        stay = recent[self.exact]
        return QuantRows(self.k, self.v, self.exact[stay], self.exact_k[stay],
                         self.exact_v[stay], self.dtype)

    def dense(self) -> tuple[Tensor, Tensor]:
        """Keys and values ``[E, d]``: dequantized, the exact rows written over."""
        keys, values = dequantize(self.k, self.dtype), dequantize(self.v, self.dtype)
        if self.exact.numel():
            keys.index_copy_(0, self.exact, self.exact_k)
            values.index_copy_(0, self.exact, self.exact_v)
        return keys, values

    def tensors(self) -> list[Tensor]:
        return [*self.k.tensors(), *self.v.tensors(), self.exact, self.exact_k, self.exact_v]

    def nbytes(self) -> int:
        return _nbytes(*self.tensors())

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        offsets = torch.tensor([0] + [len(p) for p in parts[:-1]]).cumsum(0).tolist()
        return QuantRows(Packed.cat([p.k for p in parts]), Packed.cat([p.v for p in parts]),
                         torch.cat([p.exact + o for p, o in zip(parts, offsets)]),
                         torch.cat([p.exact_k for p in parts]),
                         torch.cat([p.exact_v for p in parts]), parts[0].dtype)


def make_rows(kv: KVQuant, keys: Tensor, values: Tensor) -> PlainRows | QuantRows:
    """Rows ``[n, d]`` as a store of ``kv`` holds them."""
    return QuantRows.encode(keys, values, kv) if kv.quantized else PlainRows(keys, values)


__all__ = ["PagedRows", "PlainRows", "QuantRows", "make_rows"]
