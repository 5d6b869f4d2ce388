"""A ragged base held in pages per KV head and attended where it lies (#65): the same entries,
slots, logits and outputs as the flat base gathered into the padded view every step (the
layout before), within float tolerance where the sums run in another order; the bytes held
count the pages' padding."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build, patch_evicting, ragged_store, tiny_llama_config

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.attention.paged import PagedKV
from kvgate.cache import CompressedCache, RaggedStore
from kvgate.cache import pages as pages_mod
from kvgate.cache import ragged as ragged_mod
from kvgate.cache.fork import concat_stores
from kvgate.cache.quant import KVQuant
from kvgate.policies import Budget, get_policy


@pytest.fixture(autouse=True)
def _pages_for_few_segments(monkeypatch):
    """These bases are one sample of a few KV heads, which the store holds as flat rows
    (``ROW_SEGMENTS``, tested in test_rows.py): here on pages, as a larger batch holds them."""
    monkeypatch.setattr(pages_mod, "ROW_SEGMENTS", 0)


def _store(counts: list[int], d: int = 8, seed: int = 0) -> tuple[RaggedStore, torch.Tensor]:
    """A store of one sample whose heads keep ``counts`` entries (the first of ``max``)."""
    return ragged_store(counts, d=d, seed=seed)


def test_segments_start_on_pages_and_the_padding_is_held_and_counted():
    counts = [300, 437, 512]
    store, k = _store(counts)
    assert store.paged and store.page in pages_mod.PAGES
    first = pages_mod.first_rows(store.counts, store.page)
    assert (first % store.page == 0).all()
    held_rows = store.keys.shape[0]
    assert held_rows == int(pages_mod.segment_rows(store.counts, store.page).sum()) >= sum(counts)
    assert held_rows - sum(counts) <= pages_mod.PAD_SHARE * sum(counts)
    # every tensor as held: rows of K and V (padding included), int32 positions, counts
    assert store.nbytes() == held_rows * (2 * 8 * 4 + 4) + 3 * 8
    bk, _ = store.base_kv()  # the padded view reads the same entries as before
    for h, c in enumerate(counts):
        assert torch.equal(bk[0, h, :c], k[0, h, :c])
        assert store.slot_positions()[0, h, :c].tolist() == list(range(c))
    keys, _, seg, grid = store.pages()
    per = -(-store.base_len // store.page)
    padded = torch.zeros(3 * per, store.page, 8).index_copy_(0, grid, keys.transpose(1, 2))
    padded = padded.view(1, 3, per * store.page, 8)[:, :, :store.base_len]
    valid = store.base_slot_valid()[..., None]
    assert torch.equal(padded * valid, bk * valid)
    assert seg.tolist() == sorted(seg.tolist())


def test_paged_keys_are_held_once_each_page_transposed():
    """The ``q . k`` product reads each page's keys as they lie, a contiguous ``[d, P]``
    matrix (about 3x faster on one CPU thread than the transposed view of ``[P, d]`` rows),
    and no second copy of the keys is kept for it: the storage behind every tensor the store
    references is the bytes it counts, one row of K, V and position per held row. So after a
    prefill, and after holes and a compaction too."""
    counts = [300, 437, 512]
    store, k = _store(counts)
    _assert_held_once_transposed(store, counts, k)
    keep = torch.ones(1, 3, store.base_len, dtype=torch.bool)
    keep[0, :, :5] = False  # holes only, the pages as they were
    assert store.evict(keep) is None and store.pages()[0].data_ptr() == store.rows.keys_t.data_ptr()
    store.append(k[:, :, :2], k[:, :, :2], torch.tensor([[512, 513]]))
    keep = store.slot_valid().clone()
    keep[0, :, 5:80] = False  # past the share: compacted, new pages
    assert store.evict(keep) is not None and store.paged
    assert store.kept_counts().tolist() == [[222, 359, 434]]
    _assert_held_once_transposed(store, store.counts.tolist())


def _assert_held_once_transposed(store: RaggedStore, counts: list[int], k=None) -> None:
    keys, values, _, _ = store.pages()
    n, p = len(store.rows) // store.page, store.page
    assert keys.shape == (n, 8, p) and keys.is_contiguous()
    assert values.shape == (n, p, 8) and values.is_contiguous()
    rows = keys.transpose(1, 2).reshape(n * p, 8)  # row r: column r % P of page r // P
    torch.testing.assert_close(rows, store.keys, rtol=0, atol=0)
    if k is not None:
        for h, (first, c) in enumerate(zip(pages_mod.first_rows(store.counts, p).tolist(),
                                           counts)):
            assert torch.equal(rows[first:first + c], k[0, h, :c])
    held = n * p * (2 * 8 * 4 + 4) + 8 * len(counts)  # K, V (float32), int32 positions, counts
    assert store.nbytes() == held == _storage_bytes(store)
    assert not any(v.is_floating_point() for v in store._views.values())  # no keys cached


def _storage_bytes(store: RaggedStore) -> int:
    """The storage behind every tensor the store holds, each once (the per-layout
    bookkeeping left out: the gather index, cached views, next positions)."""
    seen = {}
    tensors = [*store.rows.tensors()] + [
        v for name, v in vars(store).items()
        if isinstance(v, torch.Tensor) and name not in {"_index", "next_pos", "holes"}]
    tensors += [getattr(store.rows, name) for name in store.rows.__slots__]
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_stacked_stores_read_their_entries_whatever_their_pages():
    """A paged store and a flat one as the rows of one batch (``concat_stores``): each
    sample's padded view as it was, the whole on pages of its own, its keys transposed."""
    paged, _ = _store([300, 437, 512])
    flat, _ = _store([8, 16, 1], seed=3)
    both = concat_stores([paged, flat])
    assert paged.paged and not flat.paged and both.paged
    got_k, got_v = both.base_kv()
    for i, store in enumerate((paged, flat)):
        for got, want in zip((got_k[i], got_v[i]), store.base_kv()):
            n = want.shape[2]
            valid = store.base_slot_valid()[0, ..., None]
            assert torch.equal(got[:, :n] * valid, want[0] * valid)
    _assert_held_once_transposed(both, both.counts.tolist())


def test_equal_heads_are_one_page_each_and_a_view():
    store, _ = _store([40, 40, 40])
    assert store.uniform and not store.paged and store.page == 40
    assert store.base_kv()[0].data_ptr() == store.keys.data_ptr()


def test_heads_that_keep_nearly_alike_are_held_as_the_padded_view():
    """One page per segment, as long as the longest, when that pads within ``VIEW_SHARE``:
    the rows are the padded view itself (``base_kv`` a view, no gather, one dense product in
    attention), the padding rows zero at position -1, held and counted; attention over it
    equals attention over the flat base gathered padded."""
    counts = [500, 497, 499]
    store, k = _store(counts, seed=4)
    assert store.padded and not store.paged and not store.uniform and store.page == 500
    keys, values = store.base_kv()
    assert keys.data_ptr() == store.keys.data_ptr() and keys.shape == (1, 3, 500, 8)
    assert store.nbytes() == 3 * 500 * (2 * 8 * 4 + 4) + 3 * 8  # the padding counted
    for h, c in enumerate(counts):
        assert torch.equal(keys[0, h, :c], k[0, h, :c])
        assert not keys[0, h, c:].any()
        assert store.slot_positions()[0, h].tolist() == list(range(c)) + [-1] * (500 - c)
    flat, _ = _store(counts, seed=4)
    flat.page, flat.rows, flat.pos = 1, *flat.packed()  # the same entries, flat
    flat._index = None
    assert not flat.padded and len(flat.rows) == sum(counts)
    q = torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(5))
    visible = store.visible_base()
    out, _ = multipart_attention(q, [KVPart(keys, values, visible)], 0.3)
    want, _ = multipart_attention(q, [KVPart(*flat.base_kv(), flat.visible_base())], 0.3)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    # past the share: pages again
    store, _ = _store([500, 400, 499])
    assert store.paged and not store.padded
    # an empty segment would hold no page: never one page each (its padding is a whole one)
    store, k = _store([28, 28, 0, 0])
    assert not store.padded and store.base_kv()[0].shape == (1, 4, 28, 8)
    assert torch.equal(store.base_kv()[0][0, 1], k[0, 1, :28])


def test_small_or_uneven_bases_stay_flat():
    store, _ = _store([3, 9, 1])
    assert store.page == 1 and not store.paged and store.keys.shape[0] == 13


@pytest.mark.parametrize("r,group", [(1, 3), (4, 2)])
def test_paged_attention_equals_the_gathered_padded_view(r, group):
    store, _ = _store([300, 437, 512], d=16, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(1, 3 * group, r, 16, generator=g)
    tail_k, tail_v = torch.randn(1, 3, 5, 16, generator=g), torch.randn(1, 3, 5, 16, generator=g)
    visible = store.base_slot_valid()[:, :, None, :] & (
        torch.rand(1, 3, r, store.base_len, generator=g) > 0.1)  # holes, windows: any mask
    visible[0, 1, 0] = False  # a row that sees nothing of one head's base
    keys, values, seg, grid = store.pages()
    paged = PagedKV(keys, values, visible, seg, grid, store.base_len, 3)
    dense = KVPart(*store.base_kv(), visible)
    tail = KVPart(tail_k, tail_v, None)
    out, logits = multipart_attention(query, [paged, tail], 0.25, return_logits=True)
    want, want_logits = multipart_attention(query, [dense, tail], 0.25, return_logits=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits == -math.inf, want_logits == -math.inf)
    torch.testing.assert_close(logits, want_logits, atol=1e-6, rtol=1e-5)


def test_a_quantized_base_stays_flat_and_gathers_its_codes():
    """Quantized rows are dequantized each step anyway: their codes are gathered into the
    padded view and dequantized there (what dequantizing all and gathering gives), and the
    bytes held are the entries' alone; a paged store converted to 8 bits becomes flat."""
    store, k = _store([300, 437, 512])
    kv = KVQuant(8, 8, residual=100)
    quantized = store.converted(kv, torch.tensor([512]))
    assert store.paged and quantized.page == 1 and not quantized.paged
    assert len(quantized.rows) == 300 + 437 + 512
    got = quantized.base_kv()
    keys, values = quantized.rows.dense()
    idx = quantized._base_index().view(-1)
    for a, rows in zip(got, (keys, values)):
        assert torch.equal(a, rows.index_select(0, idx).view_as(a))
    assert torch.equal(quantized.slot_positions(), store.slot_positions())
    fresh = RaggedStore(1, 3, 8, torch.float32, torch.device("cpu"), kv)
    fresh.append(k, k, torch.arange(512)[None])
    fresh.rebuild(store.base_slot_valid())
    assert fresh.page == 1 and fresh.nbytes() == quantized.nbytes()


def test_decoding_over_pages_equals_decoding_over_the_flat_base(monkeypatch):
    """Tokens, logits and the kept entries of every layer, step by step, as with the flat base
    gathered padded (no pages: the layout before #65's pages), through holes and compactions;
    pages of 8 rows, whatever padding they add, so that the tiny caches span several."""
    model = build(tiny_llama_config())
    patch_evicting(model, "mlp")
    ids = torch.randint(1, 100, (2, 60), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # samples of different lengths

    def run():
        cache = CompressedCache(model, get_policy("local_gate", window=4, interval=3),
                                Budget(ratio=1.0))
        logits, kept, paged = [], [], 0
        step_mask = mask
        with torch.no_grad():
            out = model(ids, attention_mask=step_mask, past_key_values=cache)
            for _ in range(ragged_mod.TAIL_MAX + 6):  # past compactions of every layer
                logits.append(out.logits[:, -1])
                kept.append([_held(layer.store) for layer in cache.layers])
                paged += sum(layer.store.paged for layer in cache.layers)
                step_mask = torch.cat([step_mask, step_mask.new_ones(2, 1)], dim=1)
                out = model(out.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                            past_key_values=cache)
        return torch.stack(logits), kept, paged, cache

    monkeypatch.setattr(pages_mod, "VIEW_SHARE", 0.0)
    monkeypatch.setattr(pages_mod, "PAD_SHARE", 1.0)
    monkeypatch.setattr(pages_mod, "PAGES", (8,))
    got, got_kept, paged, cache = run()
    monkeypatch.setattr(pages_mod, "PAGES", ())  # always flat
    want, want_kept, flat, flat_cache = run()
    assert paged > 0 and flat == 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_kept == want_kept
    assert cache.bytes_held() >= flat_cache.bytes_held()  # the pages' padding is counted
    # every ragged layout held as its padded view (one page per segment), whatever it pads
    monkeypatch.setattr(pages_mod, "VIEW_SHARE", 1.0)
    view, view_kept, paged, view_cache = run()
    assert paged == 0
    assert any(layer.store.padded for layer in view_cache.layers)
    torch.testing.assert_close(view, want, atol=1e-5, rtol=1e-5)
    assert view_kept == want_kept
    assert view_cache.bytes_held() >= flat_cache.bytes_held()
    # every ragged layout flat and read by rows (kvgate.attention.rows), however many segments
    monkeypatch.setattr(pages_mod, "VIEW_SHARE", 0.0)
    monkeypatch.setattr(pages_mod, "ROW_SEGMENTS", 10_000)
    by_rows, rows_kept, paged, rows_cache = run()
    assert paged == 0 and any(layer.store.by_rows for layer in rows_cache.layers)
    torch.testing.assert_close(by_rows, want, atol=1e-5, rtol=1e-5)
    assert rows_kept == want_kept
    assert rows_cache.bytes_held() == flat_cache.bytes_held()  # flat: no padding


def _held(store: RaggedStore) -> list[tuple[int, int, int]]:
    pos = store.slot_positions()
    at = (pos >= 0).nonzero()
    return sorted(zip(at[:, 0].tolist(), at[:, 1].tolist(), pos[pos >= 0].tolist()))
