"""A ragged base of few segments held flat and attended by rows (#65,
``kvgate.attention.rows``): every segment's query rows against all rows in one product, the
other segments' rows and the holes hidden by a bias; the same outputs and slot-view logits as
the flat base gathered into the padded view, no padding held."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ragged_store

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.attention.rows import RowKV
from kvgate.cache import RaggedStore
from kvgate.cache import pages as pages_mod


def _store(counts: list[int], batch: int = 1, d: int = 8, seed: int = 0) -> RaggedStore:
    return ragged_store(counts, batch, d, seed)[0]


def _parts(store: RaggedStore, visible: torch.Tensor) -> tuple[RowKV, KVPart]:
    rows = RowKV(*store.rows_part(), visible, store.base_len, store.kv_heads)
    return rows, KVPart(*store.base_kv(), visible)  # the gathered padded view


def test_few_segments_are_held_flat_and_read_by_rows():
    store = _store([30, 47, 12])
    assert store.flat and store.by_rows and not store.paged and not store.padded
    assert len(store.rows) == 30 + 47 + 12  # no padding held
    bias = store.row_bias()
    assert bias.shape == (3, 1, 89)
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 47, 12]))
    assert torch.equal(bias[:, 0] == 0, owner[None, :] == torch.arange(3)[:, None])
    assert torch.isinf(bias[bias != 0]).all()
    # one sample more: six segments, past ROW_SEGMENTS: on pages or flat and gathered
    wide = _store([30, 47, 12], batch=2)
    assert not wide.by_rows


@pytest.mark.parametrize("r,group", [(1, 3), (5, 2)])
def test_rows_attention_equals_the_gathered_padded_view(r, group):
    store = _store([30, 47, 12], d=16, seed=1)
    g = torch.Generator().manual_seed(2)
    keep = store.slot_valid().clone()
    keep[0, 1, 3:9] = False  # holes: marked, not compacted (within the share)
    keep[0, 0, [0, 5, 29]] = False
    assert store.evict(keep) is None and store.holes is not None
    visible = store.visible_base()
    rows, dense = _parts(store, visible)
    query = torch.randn(1, 3 * group, r, 16, generator=g)
    tail_k, tail_v = torch.randn(1, 3, 4, 16, generator=g), torch.randn(1, 3, 4, 16, generator=g)
    tail = KVPart(tail_k, tail_v, None)
    out, logits = multipart_attention(query, [rows, tail], 0.25, return_logits=True)
    want, want_logits = multipart_attention(query, [dense, tail], 0.25, return_logits=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    assert logits.shape == want_logits.shape == (1, 3 * group, r, store.base_len + 4)
    assert torch.equal(logits == -math.inf, want_logits == -math.inf)
    torch.testing.assert_close(logits, want_logits, atol=1e-6, rtol=1e-5)


def test_a_segment_that_sees_nothing_gives_zeros():
    store = _store([6, 9, 4])
    keep = store.slot_valid().clone()
    keep[0, 2] = False  # every entry of one head leaves
    store.evict(keep)
    rows, dense = _parts(store, store.visible_base())
    query = torch.randn(1, 3, 1, 8)
    out, _ = multipart_attention(query, [rows], 0.3)
    want, _ = multipart_attention(query, [dense], 0.3)
    assert not out[0, 0, 2].any() and not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


def test_the_bias_follows_holes_and_compactions():
    store = _store([20, 25, 9])
    before = store.row_bias()
    keep = store.slot_valid().clone()
    keep[0, 1, 2] = False
    store.evict(keep)  # a hole: the view is rebuilt, its row hidden from its own segment
    row = int(store.counts[0]) + 2
    assert before[1, 0, row] == 0 and store.row_bias()[1, 0, row] == -math.inf
    keep = store.slot_valid().clone()
    keep[0, :, :8] = False  # past the hole share: compacted
    assert store.evict(keep) is not None
    assert store.row_bias().shape[-1] == len(store.rows) == int(store.counts.sum())


def test_rows_are_kept_for_few_segments_only(monkeypatch):
    monkeypatch.setattr(pages_mod, "ROW_SEGMENTS", 2)
    assert not _store([30, 47, 12]).by_rows
    assert _store([30, 12]).by_rows
