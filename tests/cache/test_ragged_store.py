"""RaggedStore: flat segment-sorted layout, rebuilds, realignment, and the padded views."""

from __future__ import annotations

import torch

from kvgate.cache import RaggedStore


def _filled(b=2, hk=3, n=7, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hk, n, d, generator=g)
    v = torch.randn(b, hk, n, d, generator=g)
    pos = torch.arange(n).expand(b, n).clone()
    store = RaggedStore(b, hk, d, torch.float32, torch.device("cpu"))
    store.append(k, v, pos)
    return store, k, v


def test_rebuild_keeps_exactly_the_kept_entries_in_slot_order():
    store, k, v = _filled()
    keep = torch.rand(2, 3, 7, generator=torch.Generator().manual_seed(1)) > 0.5
    keep[0, 1] = False  # an empty head
    keep[1, 2] = True  # a full head
    store.rebuild(keep)
    assert store.kept_counts().tolist() == keep.sum(-1).tolist()
    assert store.keys.shape == (int(keep.sum()), 4)  # flat, no padding
    assert not store.uniform and store.base_len == 7
    bk, bv = store.base_kv()
    valid = store.base_slot_valid()
    for b in range(2):
        for h in range(3):
            c = int(keep[b, h].sum())
            torch.testing.assert_close(bk[b, h, :c], k[b, h, keep[b, h]])
            torch.testing.assert_close(bv[b, h, :c], v[b, h, keep[b, h]])
            assert valid[b, h].tolist() == [True] * c + [False] * (7 - c)
            pos = store.slot_positions()[b, h]
            assert pos[:c].tolist() == torch.arange(7)[keep[b, h]].tolist()
            assert (pos[c:] == -1).all()


def test_uniform_base_is_a_zero_copy_view():
    store, k, _ = _filled()
    keep = torch.zeros(2, 3, 7, dtype=torch.bool)
    keep[..., ::2] = True
    store.rebuild(keep)
    assert store.uniform and store.base_len == 4
    bk, _ = store.base_kv()
    assert bk.data_ptr() == store.keys.data_ptr()
    torch.testing.assert_close(bk, k[..., ::2, :])


def test_rebuild_merges_base_and_tail_and_realigns_stats():
    store, _, _ = _filled(n=5)
    keep = torch.ones(2, 3, 5, dtype=torch.bool)
    keep[0, 0, 1] = keep[1, 2, 3] = False
    kept = store.rebuild(keep)
    stats = torch.arange(2 * 3 * 5, dtype=torch.float32).view(2, 3, 5)
    stats = store.realign(stats, kept)
    assert stats.shape == (2, 3, 5)
    # two decode tokens; the second sample's first new token is padding
    nk, nv = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    store.append(nk, nv, torch.tensor([[5, 6], [-1, 5]]))
    assert store.tail_len == 2 and store.slots == 7
    assert store.kept_counts().tolist() == [[6, 7, 7], [6, 6, 5]]
    valid = store.slot_valid()
    assert valid[1, :, 5].tolist() == [False] * 3
    tagged = torch.cat([stats, torch.full((2, 3, 2), -1.0)], dim=-1)  # new slots
    drop = valid.clone()
    drop[:, :, 0] = False  # evict every head's first slot
    kept = store.rebuild(drop)
    out = store.realign(tagged, kept)
    assert store.tail_len == 0
    assert store.kept_counts().tolist() == [[5, 6, 6], [5, 5, 4]]
    assert store.slot_positions()[0, 0, :5].tolist() == [2, 3, 4, 5, 6]
    assert store.slot_positions()[1, 2, :5].tolist() == [1, 2, 4, 5, -1]
    assert out[0, 1, :6].tolist() == [6.0, 7.0, 8.0, 9.0, -1.0, -1.0]
    bk, _ = store.base_kv()
    torch.testing.assert_close(bk[0, 0, 3], nk[0, 0, 0])
    torch.testing.assert_close(bk[1, 2, 3], nk[1, 2, 1])


def test_nbytes_counts_every_held_tensor():
    store, _, _ = _filled(b=1, hk=2, n=10, d=8)
    keep = torch.zeros(1, 2, 10, dtype=torch.bool)
    keep[0, 0, :9] = True
    keep[0, 1, :1] = True
    store.rebuild(keep)
    kv = 10 * 2 * 8 * 4
    assert store.nbytes() == kv + 10 * 4 + 2 * 8 + 0  # keys+values, int32 pos, counts, empty tail


def test_evicting_as_many_as_appended_writes_in_place_and_spares_forks():
    """At capacity (every head keeps Tb of Tb + t slots) the kept new entries overwrite the
    evicted ones in place: no copy of the cache, stats follow their entries, and a fork made
    before still sees the old entries."""
    store, k, _ = _filled(b=2, hk=2, n=6)
    store.rebuild(torch.ones(2, 2, 6, dtype=torch.bool))
    twin = store.fork()
    nk, nv = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    store.append(nk, nv, torch.tensor([[6, 7], [6, 7]]))
    keep = store.slot_valid().clone()
    keep[0, 0, [1, 4]] = False  # two old entries out, both new ones in
    keep[0, 1, [2, 7]] = False  # one old and one new out
    keep[1, :, 6:] = False  # both new ones out
    tags = torch.arange(2 * 2 * 8, dtype=torch.float32).view(2, 2, 8)
    out = store.realign(tags, store.rebuild(keep))
    ptr = store.keys.data_ptr()
    assert store.base_len == 6 and store.uniform and store.tail_len == 0
    pos = store.slot_positions()
    assert pos[0, 0].tolist() == [0, 6, 2, 3, 7, 5]
    assert pos[0, 1].tolist() == [0, 1, 6, 3, 4, 5]
    assert pos[1, 0].tolist() == list(range(6))
    bk, bv = store.base_kv()
    torch.testing.assert_close(bk[0, 0, 1], nk[0, 0, 0])
    torch.testing.assert_close(bv[0, 1, 2], nv[0, 1, 0])
    # each slot's statistic is the one of the entry it now holds
    assert out[0, 0].tolist() == tags[0, 0, [0, 6, 2, 3, 7, 5]].tolist()
    # the fork's copy is untouched; the next in-place eviction writes the same tensors again
    torch.testing.assert_close(twin.base_kv()[0], k[:, :, :6])
    assert twin.slot_positions()[0, 0].tolist() == list(range(6))
    store.append(nk[:, :, :1], nv[:, :, :1], torch.tensor([[8], [8]]))
    keep = store.slot_valid().clone()
    keep[..., 0] = False
    store.realign(tags[..., :7], store.rebuild(keep))
    assert store.keys.data_ptr() == ptr
    assert store.slot_positions()[1, 1].tolist() == [8, 1, 2, 3, 4, 5]
