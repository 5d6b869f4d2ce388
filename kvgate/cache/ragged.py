"""Ragged storage of one layer's kept K/V entries: the bytes held follow the kept entries.

Layout (``S = B * H_kv`` segments, segment ``s = b * H_kv + h``):

- *base*: ``rows`` (``kvgate.cache.rows``: keys / values ``[R, d]``, a paged base's keys
  transposed page by page) sorted by segment, then by slot; ``pos`` ``[R]`` int32 true
  positions; ``counts`` ``[S]``. Each segment's rows start on a page boundary and
  only its last page is padded (``kvgate.cache.pages``: ``page`` rows, chosen at each layout;
  the padding is held and counted in ``nbytes``), so heads that keep very different numbers of
  tokens cost what they keep plus less than a page each.
- *tail*: dense ``[B, H_kv, t, d]`` tokens appended since the last rebuild. Every KV head
  receives every new token, so the tail is rectangular; ``tail_pos`` ``[B, t]`` (-1 = padding).

What policies and attention see is the *slot view*, padded per segment: slots ``0..Tb-1`` are
the base (``Tb`` = longest segment; slot ``j`` of segment ``s`` is real iff
``j < counts[s]``), slots ``Tb..Tb+t-1`` the tail. Only small per-slot tensors (masks,
positions, scores, logits) are materialised padded. Attention reads a paged base where it lies
(``pages``); ``base_kv`` gives the padded view: of a uniform base, or one held as its padded
view (``padded``: heads that keep nearly alike, one page each), a view, else a transient
gather. The per-slot positions, base validity and page indices are kept per layout
(bookkeeping: not counted in ``nbytes``), the positions marked by ``evict`` and grown to new
slots when read, so a decode step gathers them not.

*Holes*: an entry evicted while decoding is first only marked (``holes`` ``[B, H_kv, T']``
over the first ``T'`` slots: those appended since are none, so an append leaves it as it is;
``hole_mask`` gives it over all ``T``): it drops out of every view (``slot_valid``,
``slot_positions``, ``visible_base`` / ``tail_holes``, ``kept_counts``) at once, and its bytes
are freed by the next rebuild, which ``evict`` runs only once the holes pass ``HOLE_SHARE`` of
the held slots or the tail reaches ``TAIL_MAX`` tokens. A policy that drops one token a step
(KVzap's rule: the token leaving the window when it scores below the threshold) then copies the
cache every few dozen steps instead of every step; the bytes held overstate the kept entries by
at most that share until then.

Quantized (``kv``, ``kvgate.cache.quant.KVQuant`` with 8 or 4 bits): the base rows are held as
codes with per-group scales and zero points (``kvgate.cache.rows.QuantRows``), quantized as
they enter the base (at a rebuild); the base rows of the last ``kv.residual`` positions of each
sample keep an exact copy besides, dropped at the first rebuild after they leave that window,
and the tail is full precision. ``base_kv`` dequantizes the base at each call (no dequantized
copy is kept; a ragged base flat, its codes gathered into the padded view first). Slots,
positions, holes and every per-slot view are the same as unquantized.

Slot order: a rebuild compacts the kept slots in their old order (position order after a
prefill). A decode step that evicts exactly as many entries per segment as it appends (a
decode-evicting policy at capacity) instead writes the kept new entries over the evicted
ones in place, so it copies ``r`` entries, not the cache; slots are then no longer in position
order, which nothing reads (positions are stored per slot).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from kvgate.cache.base_reads import BaseReads
from kvgate.cache.pages import first_rows, page_for, placed, segment_rows
from kvgate.cache.quant import KVQuant
from kvgate.cache.rows import PagedRows, PlainRows, QuantRows, make_rows

# when ``evict`` compacts: the holes pass this share of the held slots, or the tail this length
HOLE_SHARE = 0.125
TAIL_MAX = 64


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class RaggedStore(BaseReads):
    """Kept keys/values of one layer for ``batch`` samples x ``kv_heads`` heads of ``head_dim``."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, kv: KVQuant | None = None) -> None:
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.kv = KVQuant() if kv is None else kv  # how the base holds its rows
        segs = batch * kv_heads
        empty = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.rows: PlainRows | PagedRows | QuantRows = make_rows(self.kv, empty, empty.clone())
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)  # 1 + newest position
        self.pos = torch.empty(0, dtype=torch.int32, device=device)
        self.counts = torch.zeros(segs, dtype=torch.long, device=device)
        self.tail_k: Tensor | None = None
        self.tail_v: Tensor | None = None
        self.tail_pos = torch.empty(batch, 0, dtype=torch.int32, device=device)
        self.tail_padded = False  # some tail token is padding (only while streaming a prompt)
        self._base_len = 0
        self._uniform = True
        self.page = 1  # rows per page of the base (module docstring)
        self._index: Tensor | None = None  # [S, Tb] row of every base slot (lazy)
        # per-layout views of the stored data (bookkeeping, like _index: not in nbytes), built
        # lazily, dropped when the layout changes: "base_valid" [B, H_kv, Tb]; "page_seg",
        # "page_grid" [N_pages] (pages); "base_visible" [B, H_kv, 1, Tb] (dropped too when holes
        # are marked); "row_bias" [S, 1, R] (flat bases; dropped too when holes are marked);
        # "slot_pos" [B, H_kv, T'], marked by evict, grown by slot_positions to T
        self._views: dict[str, Tensor] = {}
        self._held: int | None = None  # entries in the base (lazy: counts.sum())
        self._hole_count = 0  # slots marked in holes
        self.holes: Tensor | None = None  # [B, H_kv, T'] evicted, not yet compacted (None: none)
        self._tail_holes = False  # some hole lies in the tail
        self._owned = True  # keys / values / pos are this store's alone (forks share them)

    # ------------------------------------------------------------------ sizes

    @property
    def base_len(self) -> int:
        """``Tb``: slots of the base in the padded view (the longest segment)."""
        return self._base_len

    @property
    def tail_len(self) -> int:
        return self.tail_pos.shape[1]

    @property
    def slots(self) -> int:
        """``T = Tb + t``: slots per segment in the padded view."""
        return self._base_len + self.tail_len

    @property
    def uniform(self) -> bool:
        """True when every segment of the base holds the same number of entries."""
        return self._uniform

    def kept_counts(self) -> Tensor:
        """Real entries per (sample, KV head), base and tail, holes left out: ``[B, H_kv]``."""
        base = self.counts.view(self.batch, self.kv_heads)
        tail = (self.tail_pos >= 0).sum(-1, dtype=torch.long)
        held = base + tail[:, None]
        return held if self.holes is None else held - self.holes.sum(-1)

    @property
    def keys(self) -> Tensor:
        """The base keys ``[R, d]``, pages' padding included (dequantized when the rows are
        quantized, a copy when paged)."""
        return self.rows.dense()[0]

    @property
    def values(self) -> Tensor:
        return self.rows.dense()[1]

    def held_tensors(self) -> list[Tensor]:
        """Every tensor of stored data: the base rows (K/V, or their codes, scales, zero
        points and the residual window's exact rows), positions, counts and the tail."""
        return [t for t in (*self.rows.tensors(), self.pos, self.counts, self.tail_k,
                            self.tail_v, self.tail_pos) if t is not None]

    def nbytes(self) -> int:
        """Bytes of every tensor the store holds (``held_tensors``)."""
        return sum(_nbytes(t) for t in self.held_tensors())

    def fork(self) -> RaggedStore:
        """An independent copy that shares the stored tensors (copy-on-write).

        ``append`` and ``rebuild`` bind new tensors, except the in-place eviction, which first
        copies tensors it shares; so a fork may append and evict freely without touching the
        original.
        """
        twin = copy.copy(self)
        twin._views = dict(self._views)  # the views are never written into: sharing them is safe
        self._owned = twin._owned = False
        return twin

    # ------------------------------------------------------------------ writing

    def append(self, keys: Tensor, values: Tensor, pos: Tensor, padded: bool | None = None) -> None:
        """Add new tokens to every head: keys/values ``[B, H_kv, r, d]``, pos ``[B, r]`` (-1 pad).

        ``padded``: whether ``pos`` holds a padding token, when the caller knows already.
        """
        pos = pos.to(torch.int32)
        self.tail_padded |= bool((pos < 0).any()) if padded is None else padded
        if self.kv.quantized:  # the residual window ends at the newest position
            self.next_pos = torch.maximum(self.next_pos, pos.amax(-1).long() + 1)
        # the new slots are no holes, and their positions join the view when it is read next
        if self.tail_k is None:
            # the first block is kept by reference: a rebuild usually follows right away
            self.tail_k, self.tail_v, self.tail_pos = keys, values, pos
            return
        self.tail_k = torch.cat([self.tail_k, keys], dim=2)
        self.tail_v = torch.cat([self.tail_v, values], dim=2)
        self.tail_pos = torch.cat([self.tail_pos, pos], dim=1)

    def rebuild(self, keep: Tensor) -> Tensor:
        """Keep only the slots where ``keep`` [B, H_kv, T] is True; the tail moves into the base.

        Returns the moves ``[S, Tb']``: the old slot each new base slot holds (0 at padding),
        which ``realign`` reads to carry per-slot statistics over to the new layout.
        """
        b, hk, segs = self.batch, self.kv_heads, self.batch * self.kv_heads
        tb, t = self._base_len, self.tail_len
        keep = keep.to(torch.bool) & self.slot_valid()
        flat = keep.reshape(segs, tb + t)
        if t and tb and self._uniform and not self.tail_padded \
                and bool((flat.sum(-1) == tb).all()):
            return self._replace(flat)
        moves = self._compaction_moves(flat)
        kb, kt = flat[:, :tb], keep[..., tb:]
        if t == 0:
            # base only: the row-major order of the kept slots is already segment-sorted
            src = self._base_index()[kb]
            rows, pos = self.rows.take(src), self.pos[src]
        elif tb == 0:
            rows = make_rows(self.kv, self.tail_k[kt], self.tail_v[kt])
            pos = self.tail_pos[:, None, :].expand(b, hk, t)[kt]
        else:
            dest = flat.reshape(-1).cumsum(0).view(segs, tb + t) - 1
            total = int(flat.sum())
            rows = self.rows.empty(total)
            pos = torch.empty(total, dtype=torch.int32, device=self.device)
            src, dst = self._base_index()[kb], dest[:, :tb][kb]
            rows.put_(dst, self.rows.take(src))
            pos[dst] = self.pos[src]
            dst = dest[:, tb:][kt.reshape(segs, t)]
            rows.put_(dst, make_rows(self.kv, self.tail_k[kt], self.tail_v[kt]))
            pos[dst] = self.tail_pos[:, None, :].expand(b, hk, t)[kt]
        self.fill(rows, pos, flat.sum(-1))
        self.tail_k = self.tail_v = None
        self.tail_pos = self.tail_pos.new_empty(b, 0)
        self.tail_padded = False
        self._owned = True
        self._new_layout()
        self._age()
        return moves[:, :self._base_len]

    def fill(self, rows: PlainRows | QuantRows, pos: Tensor, counts: Tensor) -> None:
        """Hold ``rows`` / int32 ``pos`` (flat, segment-sorted) of ``counts`` ``[S]`` entries
        per segment as the base, on pages (``kvgate.cache.pages``); its derived views stale."""
        self.counts = counts
        lo, hi = torch.aminmax(counts)
        self._base_len, self._uniform = int(hi), bool(lo == hi)
        self.page = page_for(counts, self._base_len, self._uniform, self.kv.quantized)
        self.rows, self.pos = placed(rows, pos, counts, self.page, self._uniform, self._base_len)
        self._index = None

    def packed(self) -> tuple[PlainRows | QuantRows, Tensor]:
        """The base's entries flat, segment-sorted (``fill``'s input): rows and positions."""
        if self.page == 1 or self._uniform:
            return self.rows, self.pos
        src = self._base_index()[self.base_slot_valid().view(self.batch * self.kv_heads, -1)]
        return self.rows.take(src), self.pos[src]

    def _compaction_moves(self, flat: Tensor) -> Tensor:
        """``[S, T]``: the old slots kept in each segment, in order, then 0."""
        moves = torch.zeros_like(flat, dtype=torch.long)
        seg, slot = flat.nonzero(as_tuple=True)
        moves[seg, (flat.long().cumsum(-1) - 1)[seg, slot]] = slot
        return moves

    def _replace(self, flat: Tensor) -> Tensor:
        """Every segment keeps ``Tb`` of its ``Tb + t`` slots: the kept tail entries overwrite
        the evicted base entries in place (the k-th evicted slot of a segment takes its k-th
        kept tail entry), the base keeps its size and layout."""
        segs, tb, t = self.batch * self.kv_heads, self._base_len, self.tail_len
        if not self._owned:  # shared with a fork: copy before writing
            self.rows, self.pos = self.rows.clone(), self.pos.clone()
            self._owned = True
        # equal counts per segment, both lists segment-major: the k-th of each pair up
        seg, slot = (~flat[:, :tb]).nonzero(as_tuple=True)
        tseg, tslot = flat[:, tb:].nonzero(as_tuple=True)
        dst = seg * tb + slot  # a uniform base: segment s holds flat rows [s * tb, (s + 1) * tb)
        d = self.head_dim
        self.rows.put_(dst, make_rows(self.kv, self.tail_k.reshape(segs, t, d)[tseg, tslot],
                                      self.tail_v.reshape(segs, t, -1)[tseg, tslot]))
        self.pos[dst] = self.tail_pos[tseg // self.kv_heads, tslot]
        moves = torch.arange(tb, device=flat.device).expand(segs, tb).clone()
        moves[seg, slot] = tb + tslot
        self.tail_k = self.tail_v = None
        self.tail_pos = self.tail_pos.new_empty(self.batch, 0)
        self._new_layout()
        self._age()
        return moves

    def _new_layout(self) -> None:
        """After a rebuild or an in-place replacement: no holes, the derived views stale."""
        self.holes, self._hole_count, self._tail_holes = None, 0, False
        self._views, self._held = {}, None

    def _age(self) -> None:
        """Quantized rows: drop the exact copy of every base row that left the residual
        window (position below each sample's newest position + 1 - ``kv.residual``)."""
        if not self.kv.quantized:
            return
        start = (self.next_pos - self.kv.residual).repeat_interleave(self.kv_heads)  # [S]
        rows = segment_rows(self.counts, self.page)  # padding rows included
        floor = start.repeat_interleave(rows, output_size=self.pos.shape[0])
        self.rows = self.rows.aged(self.pos >= floor)

    def converted(self, kv: KVQuant, seen: Tensor) -> RaggedStore:
        """This store's entries held as ``kv`` says, in a new store (same slots, tail and
        holes; the base quantized from full precision, or as it is when ``kv`` is its own);
        ``seen`` ``[B]``: real tokens seen, where the residual window ends."""
        if kv == self.kv:
            return self
        if self.kv.quantized:
            raise ValueError(f"a store of {self.kv.describe()} entries cannot become "
                             f"{kv.describe()}: quantize from full precision only")
        twin = self.fork()
        rows, twin.pos = self.packed()  # a ragged quantized base is flat (module docstring)
        twin.kv, twin.rows = kv, make_rows(kv, *rows.dense())
        if twin.page > 1 and not twin._uniform:
            twin.page, twin._index = 1, None
            twin._views = {k: v for k, v in twin._views.items() if not k.startswith("page_")}
        twin.next_pos = seen.to(self.next_pos)  # a full-precision store does not track it
        twin._age()
        return twin

    def evict(self, keep: Tensor) -> Tensor | None:
        """Drop the held slots where ``keep`` [B, H_kv, T] is False, the way that copies least:
        marked as holes, or (once the holes pass ``HOLE_SHARE`` of the held slots, or the tail
        ``TAIL_MAX`` tokens) compacted by ``rebuild``. Returns ``rebuild``'s moves when the
        layout changed, None when only holes were marked (per-slot statistics stay aligned)."""
        dropped = self.slot_valid() & ~keep.to(torch.bool)
        return self.drop(dropped, int(dropped.sum()))

    def drop(self, dropped: Tensor, count: int) -> Tensor | None:
        """``evict`` given what leaves: ``dropped`` [B, H_kv, T] bool, real slots only (no
        hole marked twice), ``count`` of them (the caller's one read of the device)."""
        if self._held is None:
            self._held = int(self.counts.sum())
        tail = self.tail_len if not self.tail_padded else int((self.tail_pos >= 0).sum())
        holes = self._hole_count + count
        if self.tail_len >= TAIL_MAX or holes > HOLE_SHARE * (self._held + self.kv_heads * tail):
            return self.rebuild(~dropped)  # rebuild keeps real slots only
        if count:
            if "slot_pos" in self._views:
                self._views["slot_pos"] = self.slot_positions().masked_fill(dropped, -1)
            self.holes = dropped if self.holes is None else self.hole_mask() | dropped
            self._hole_count = holes
            # a hole in the tail makes attention mask the tail too (one read per round)
            self._tail_holes = self._tail_holes or bool(dropped[..., self._base_len:].any())
            self._views.pop("base_visible", None)
            self._views.pop("row_bias", None)
        return None

    def realign(self, x: Tensor, moves: Tensor) -> Tensor:
        """Carry a per-slot tensor ``x`` [B, H_kv, T] of the old view to the rebuilt one, given
        the ``moves`` that ``rebuild`` returned (0 at padding slots)."""
        segs = self.batch * self.kv_heads
        out = x.reshape(segs, -1).gather(1, moves).view(self.batch, self.kv_heads, -1)
        return out.masked_fill(~self.base_slot_valid(), 0)

    # ------------------------------------------------------------------ reading

    def _base_index(self) -> Tensor:
        """``[S, Tb]`` row of each base slot (clamped into range at empty slots)."""
        if self._index is None:
            first = first_rows(self.counts, self.page)
            idx = first[:, None] + torch.arange(self._base_len, device=self.device)
            self._index = idx.clamp(max=max(len(self.rows) - 1, 0))
        return self._index

    def base_slot_valid(self) -> Tensor:
        """``[B, H_kv, Tb]`` True at real base slots."""
        valid = self._views.get("base_valid")
        if valid is None:
            ar = torch.arange(self._base_len, device=self.device)
            valid = (ar < self.counts[:, None]).view(self.batch, self.kv_heads, self._base_len)
            self._views["base_valid"] = valid
        return valid

    def slot_valid(self) -> Tensor:
        """``[B, H_kv, T]`` True at real slots (base entries and non-padding tail tokens), holes
        left out."""
        if "slot_pos" in self._views:  # -1 exactly at empty slots, padding and holes
            return self.slot_positions() >= 0
        tail = (self.tail_pos >= 0)[:, None, :].expand(self.batch, self.kv_heads, -1)
        valid = torch.cat([self.base_slot_valid(), tail], dim=-1)
        return valid if self.holes is None else valid & ~self.hole_mask()

    def hole_mask(self) -> Tensor | None:
        """``[B, H_kv, T]`` True at the slots marked as holes (None: none)."""
        holes, grown = self.holes, self.slots - (0 if self.holes is None else self.holes.shape[-1])
        if holes is None or not grown:
            return holes
        return torch.nn.functional.pad(holes, (0, grown))

    def slot_positions(self) -> Tensor:
        """``[B, H_kv, T]`` long true positions, -1 at empty slots and holes (built once
        per layout, then grown by ``append`` and marked by ``evict``: a decode step reads it
        without a gather over the base)."""
        slots = self._views.get("slot_pos")
        if slots is None:
            base = self.pos.index_select(0, self._base_index().view(-1)).long()
            base = base.view(self.batch, self.kv_heads, -1).masked_fill(~self.base_slot_valid(), -1)
            tail = self.tail_pos.long()[:, None, :].expand(self.batch, self.kv_heads, -1)
            slots = torch.cat([base, tail], dim=-1)
            slots = slots if self.holes is None else slots.masked_fill(self.hole_mask(), -1)
            self._views["slot_pos"] = slots
        elif slots.shape[-1] < self.slots:  # the slots appended since it was last read
            new = self.tail_pos[:, slots.shape[-1] - self.slots:].long()
            slots = torch.cat([slots, new[:, None, :].expand(self.batch, self.kv_heads, -1)], -1)
            self._views["slot_pos"] = slots
        return slots

    def visible_base(self, seen: Tensor | None = None) -> Tensor | None:
        """``[B, H_kv, 1, Tb]`` the base slots attention may read (None: all of them, a
        uniform base without holes); ``seen``: that mask when the caller has it already
        (``slot_positions() >= 0`` over the base), given back unless every slot is read."""
        if self._uniform and self.holes is None:
            return None
        if seen is not None:
            return seen
        visible = self._views.get("base_visible")  # until holes are marked (``drop``)
        if visible is None:
            visible = self.base_slot_valid()
            if self.holes is not None:
                visible = visible & ~self.holes[..., :self._base_len]
            visible = self._views["base_visible"] = visible[:, :, None, :]
        return visible

    def tail_holes(self) -> Tensor | None:
        """``[B, H_kv, 1, t]`` True at tail slots evicted but not compacted (None: none)."""
        if not self._tail_holes:
            return None
        return self.hole_mask()[:, :, None, self._base_len:]

    def tail_kv(self) -> tuple[Tensor | None, Tensor | None]:
        return self.tail_k, self.tail_v
