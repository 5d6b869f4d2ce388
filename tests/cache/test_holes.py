"""Entries evicted while decoding are marked as holes and compacted only once they pass a share
(#65: KVzap's rule drops about one token a step, and a compaction per layer and step used to
make the gate's decode slower than the full cache's)."""

from __future__ import annotations

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config

from kvgate.cache import CompressedCache, RaggedStore
from kvgate.cache import ragged as ragged_mod
from kvgate.policies import Budget, get_policy


def _store(b=1, hk=2, n=40, d=4):
    g = torch.Generator().manual_seed(0)
    store = RaggedStore(b, hk, d, torch.float32, torch.device("cpu"))
    store.append(torch.randn(b, hk, n, d, generator=g), torch.randn(b, hk, n, d, generator=g),
                 torch.arange(n).expand(b, n))
    store.rebuild(torch.ones(b, hk, n, dtype=torch.bool))  # a prefill: all in the base
    return store


def test_a_few_evictions_are_holes_without_a_copy_and_leave_every_view():
    store = _store()
    keys, held = store.keys, store.nbytes()
    keep = torch.ones(1, 2, 40, dtype=torch.bool)
    keep[0, 0, 3] = keep[0, 1, 7] = False
    assert store.evict(keep) is None  # 2 of 80 held: marked only
    assert store.keys is keys and store.nbytes() == held  # nothing copied, nothing freed yet
    assert store.kept_counts().tolist() == [[39, 39]]
    assert not store.slot_valid()[0, 0, 3] and store.slot_positions()[0, 1, 7] == -1
    visible = store.visible_base()
    assert visible is not None and not visible[0, 0, 0, 3] and visible[0, 0, 0, 4]
    # a new token is no hole, and a later eviction adds to the marks
    store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([[40]]))
    assert store.hole_mask().shape == (1, 2, 41) and not store.hole_mask()[..., 40].any()
    assert store.holes.shape == (1, 2, 40)  # the mark is not grown by an append
    assert store.kept_counts().tolist() == [[40, 40]]


def test_holes_past_the_share_are_compacted_and_their_bytes_freed():
    store = _store()
    held = store.nbytes()
    keep = torch.ones(1, 2, 40, dtype=torch.bool)
    keep[0, :, :11] = False  # 22 of 80 held: past the share
    assert store.evict(keep) is not None
    assert store.holes is None and store.kept_counts().tolist() == [[29, 29]]
    assert store.nbytes() < held and store.keys.shape[0] == 58
    assert store.slot_positions()[0, 0].tolist() == list(range(11, 40))


def test_a_long_tail_is_compacted_even_without_holes_enough():
    store = _store()
    for t in range(ragged_mod.TAIL_MAX):
        store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.tensor([[40 + t]]))
    keep = store.slot_valid().clone()
    keep[0, 0, 0] = False
    assert store.evict(keep) is not None and store.tail_len == 0


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_decoding_with_holes_equals_decoding_with_a_compaction_each_step(kind, monkeypatch):
    """The same tokens, kept entries and attention outputs whether evictions wait as holes or
    are compacted at once (HOLE_SHARE 0: the old behaviour); a round every step (interval 1)
    so that the 12 steps evict."""
    model = build(tiny_llama_config())
    patch_evicting(model, kind)
    ids = torch.randint(1, 100, (2, 24), generator=torch.Generator().manual_seed(4))

    def run():
        cache = CompressedCache(model, get_policy("local_gate", window=4, interval=1),
                                Budget(ratio=1.0))
        steps, counts = [], []
        with torch.no_grad():
            out = model(ids, past_key_values=cache)
            for _ in range(12):
                steps.append(out.logits[:, -1])
                counts.append(torch.stack([cache.kept_counts(i) for i in range(2)]))
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
        return torch.stack(steps), torch.stack(counts), cache

    lazy_logits, lazy_counts, lazy = run()
    assert any(layer.store.holes is not None for layer in lazy.layers)  # holes were used
    monkeypatch.setattr(ragged_mod, "HOLE_SHARE", 0.0)
    eager_logits, eager_counts, eager = run()
    assert all(layer.store.holes is None for layer in eager.layers)
    torch.testing.assert_close(lazy_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(lazy_counts, eager_counts)
    assert lazy.bytes_held() >= eager.bytes_held()  # holes are held until compacted
