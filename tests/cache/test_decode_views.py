"""A decode step reads the ragged store's per-layout views (slot positions grown by ``append``
and marked by ``evict``, base validity) instead of rebuilding them, and the local gate scores
a new row without its gradient terms (#65): the same views, tokens, logits and kept entries
as building everything afresh each step."""

from __future__ import annotations

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config

from kvgate.cache import CompressedCache, RaggedStore
from kvgate.cache.ragged import TAIL_MAX
from kvgate.policies import Budget, get_policy
from kvgate.policies.attention_gate import by_kv_head
from kvgate.policies.local_gate import LocalGatePolicy


def _fresh_positions(store: RaggedStore) -> torch.Tensor:
    """``slot_positions`` from the stored data alone, as it read before the views."""
    b, hk, tb = store.batch, store.kv_heads, store.base_len
    start = store.counts.cumsum(0) - store.counts
    slot = torch.arange(tb)
    base = store.pos[(start[:, None] + slot).clamp(max=max(len(store.pos) - 1, 0))].long()
    base = base.view(b, hk, tb).masked_fill((slot >= store.counts[:, None]).view(b, hk, tb), -1)
    tail = store.tail_pos.long()[:, None, :].expand(b, hk, -1)
    slots = torch.cat([base, tail], dim=-1)
    return slots if store.holes is None else slots.masked_fill(store.hole_mask(), -1)


def test_views_follow_appends_holes_compactions_and_forks():
    g = torch.Generator().manual_seed(3)
    b, hk, n, d = 2, 3, 30, 4
    store = RaggedStore(b, hk, d, torch.float32, torch.device("cpu"))
    store.append(torch.randn(b, hk, n, d, generator=g), torch.randn(b, hk, n, d, generator=g),
                 torch.arange(n).expand(b, n))
    store.rebuild(torch.rand(b, hk, n, generator=g) < 0.6)  # a ragged base
    assert not store.uniform
    twin = None
    for step in range(TAIL_MAX + 10):  # past a compaction by the tail's length
        store.append(torch.randn(b, hk, 1, d, generator=g), torch.randn(b, hk, 1, d, generator=g),
                     torch.full((b, 1), n + step))
        assert torch.equal(store.slot_positions(), _fresh_positions(store))
        keep = torch.rand(b, hk, store.slots, generator=g) > 0.04
        store.evict(keep)
        positions = store.slot_positions()
        assert torch.equal(positions, _fresh_positions(store))
        assert torch.equal(store.slot_valid(), positions >= 0)
        visible = store.visible_base()
        if visible is not None:
            assert torch.equal(visible[:, :, 0], positions[..., :store.base_len] >= 0)
        if step == 5:  # a fork goes its own way from here: the original must not see it
            twin, before = store.fork(), positions
    assert twin is not None and torch.equal(twin.slot_positions(), before)
    assert store.kept_counts().sum() < b * hk * (n + TAIL_MAX)  # holes and compactions ran


@pytest.mark.parametrize("kind,options", [("mlp", {}), ("linear", {}), ("mlp", {"tau": 0.4}),
                                          ("mlp", {"threshold": 0.0})])
def test_decoding_equals_building_the_views_afresh_each_step(kind, options, monkeypatch):
    """Tokens, logits and the kept (position, head) entries of every layer, step by step, equal
    to a run whose views are dropped before every read and whose gate flags come from
    ``Gate.forward`` (the path before #65's decode work)."""
    model = build(tiny_llama_config())
    patch_evicting(model, kind)
    ids = torch.randint(1, 100, (2, 20), generator=torch.Generator().manual_seed(5))

    def run():
        cache = CompressedCache(model, get_policy("local_gate", window=4, **options),
                                Budget(ratio=1.0))
        logits, kept = [], []
        with torch.no_grad():
            out = model(ids, past_key_values=cache)
            for _ in range(TAIL_MAX + 8):  # past a compaction of each layer
                logits.append(out.logits[:, -1])
                kept.append([_held(layer.store) for layer in cache.layers])
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
        return torch.stack(logits), kept

    fast_logits, fast_kept = run()
    slot_positions = RaggedStore.slot_positions

    def afresh(store):
        store._views = {}
        return slot_positions(store)

    def gate_forward(self, rows):  # row_stats as it read before
        gate, (b, hk, r) = rows.module.kv_gate, rows.key.shape[:3]
        if rows.module.layer_idx < gate.config.ungated_layers:
            flags = torch.ones(b, hk, r, dtype=torch.bool)
        else:
            flags = by_kv_head(gate(rows.hidden, tau=self.tau).detach() > 0.5
                               if self.threshold is None
                               else gate.scores(rows.hidden) >= self.threshold, hk, "any")
        return {"above": (flags & rows.valid[:, None, :]).float()}

    monkeypatch.setattr(RaggedStore, "slot_positions", afresh)
    monkeypatch.setattr(LocalGatePolicy, "row_stats", gate_forward)
    slow_logits, slow_kept = run()
    assert torch.equal(fast_logits, slow_logits)
    assert fast_kept == slow_kept
    assert any(len(a) != len(b) for a, b in zip(fast_kept[0], fast_kept[-1]))  # it evicted


def _held(store: RaggedStore) -> list[tuple[int, int, int]]:
    """The (sample, KV head, position) entries a store holds, sorted."""
    positions = _fresh_positions(store)
    at = (positions >= 0).nonzero()  # row-major, as the boolean index below
    return sorted(zip(at[:, 0].tolist(), at[:, 1].tolist(), positions[positions >= 0].tolist()))
