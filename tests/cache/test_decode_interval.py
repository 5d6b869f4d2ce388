"""The local gate's decode-time eviction every ``interval`` rows (#65): the rows written since
the last round are scored in one call of the gate and leave in one round. Interval 1 is the
round after every step; with interval k the kept set right after each round is the one the
rule gives evicting step by step, and between rounds only the rows written since are added."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config

from kvgate.cache import CompressedCache
from kvgate.cache.fork import fork_cache
from kvgate.cache.ragged import TAIL_MAX
from kvgate.policies import Budget, PolicyError, get_policy
from kvgate.policies.contract import LayerPrompt
from kvgate.policies.local_gate import LocalGatePolicy
from kvgate.policies.registry import policy_spec

WINDOW = 4


def _held(store) -> set[tuple[int, int, int]]:
    """The (sample, KV head, position) entries a store holds."""
    pos = store.slot_positions()
    at = (pos >= 0).nonzero()
    return set(zip(at[:, 0].tolist(), at[:, 1].tolist(), pos[pos >= 0].tolist()))


def _by_position(self, rows: LayerPrompt) -> dict[str, torch.Tensor]:
    """A scorer that reads only each row's position (through its rotary cos), so that its
    flags do not depend on what the row attended to: runs of different intervals then score
    the same token alike, and their kept sets can be compared entry by entry."""
    b, hk, r = rows.key.shape[:3]
    flags = rows.position_embeddings[0][..., 1] > 0  # [B, r]: a pattern over positions
    return {"above": (flags[:, None, :].expand(b, hk, r) & rows.valid[:, None, :]).float()}


def _decode(model, interval: int, steps: int, ids, feed, kv_bits: int = 16):
    """Teacher-forced decoding (``feed``: the same tokens whatever the cache holds); the kept
    entries of every layer after the prefill, then after each step."""
    cache = CompressedCache(model, get_policy("local_gate", window=WINDOW, interval=interval),
                            Budget(ratio=1.0), kv_bits=kv_bits)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        kept = [[_held(layer.store) for layer in cache.layers]]
        for i in range(steps):
            model(feed[:, i:i + 1], past_key_values=cache)
            kept.append([_held(layer.store) for layer in cache.layers])
    return kept, cache


@pytest.mark.parametrize("interval", [3, 16])
def test_the_kept_set_after_each_round_is_the_step_by_step_one(interval, monkeypatch):
    monkeypatch.setattr(LocalGatePolicy, "row_stats", _by_position)
    model = build(tiny_llama_config())
    patch_evicting(model, "mlp")
    g = torch.Generator().manual_seed(2)
    n, steps = 20, 40
    ids, feed = (torch.randint(1, 100, (2, n), generator=g),
                 torch.randint(1, 100, (2, steps), generator=g))
    every, _ = _decode(model, 1, steps, ids, feed)
    batched, cache = _decode(model, interval, steps, ids, feed)
    last = 0  # the state right after the last round (0: the prefill's)
    for i in range(1, steps + 1):  # after step i (its row at position n + i - 1)
        if i % interval == 0:  # a round ended this step
            assert batched[i] == every[i], f"step {i}"
            last = i
            continue
        # rows written since the last round wait, every other entry is as the round left it
        waiting = {(b, h, n + j) for b in range(2) for h in range(cache.kv_heads)
                   for j in range(last, i)}
        assert batched[i] == [held | waiting for held in every[last]], f"step {i}"
    # the rule evicted while decoding: some entry held after one step is gone after the next
    assert any(a - b for before, after in pairwise(every)
               for a, b in zip(before, after))


def test_rows_scored_at_once_equal_rows_scored_one_by_one():
    model = build(tiny_llama_config())
    patch_evicting(model, "mlp")
    policy = get_policy("local_gate", window=WINDOW)
    module = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(3)
    parts = []
    for _ in range(5):
        key = torch.randn(2, 2, 1, 16, generator=g)
        parts.append(LayerPrompt(1, 2, torch.randn(2, 4, 1, 16, generator=g), key, key,
                                 torch.ones(2, 1, dtype=torch.bool), 0.25,
                                 torch.randn(2, 1, 64, generator=g), module))
    with torch.no_grad():
        joined = policy.row_stats(LayerPrompt.joined(parts))["above"]
        one_by_one = torch.cat([policy.row_stats(p)["above"] for p in parts], dim=-1)
        scores = module.kv_gate.scores(LayerPrompt.joined(parts).hidden)
        each = torch.cat([module.kv_gate.scores(p.hidden) for p in parts], dim=-1)
    torch.testing.assert_close(scores, each)
    assert torch.equal(joined, one_by_one)


def _above_by_entry(cache) -> list[dict[tuple[int, int, int], float]]:
    """Each layer's ``above`` statistic by held (sample, KV head, position)."""
    out = []
    for layer in cache.layers:
        pos = layer.store.slot_positions()
        at = (pos >= 0).nonzero()
        out.append(dict(zip(zip(at[:, 0].tolist(), at[:, 1].tolist(), pos[pos >= 0].tolist()),
                            layer.stats["above"][pos >= 0].tolist())))
    return out


def test_a_quantized_tail_is_never_compacted_before_its_rows_are_scored(monkeypatch):
    """A round longer than the tail's compaction (``TAIL_MAX``) comes early, so that the rows'
    scores land in their own slots before the compaction moves them; forks keep their rows
    apart."""
    monkeypatch.setattr(LocalGatePolicy, "row_stats", _by_position)
    model = build(tiny_llama_config())
    patch_evicting(model, "mlp")
    g = torch.Generator().manual_seed(4)
    ids, feed = (torch.randint(1, 100, (1, 20), generator=g),
                 torch.randint(1, 100, (1, TAIL_MAX), generator=g))
    every, reference = _decode(model, 1, TAIL_MAX, ids, feed, kv_bits=8)
    _, cache = _decode(model, TAIL_MAX + 20, TAIL_MAX - 1, ids, feed, kv_bits=8)
    assert all(len(layer.unscored) == TAIL_MAX - 1 for layer in cache.layers)
    twin = fork_cache(cache)
    with torch.no_grad():
        model(feed[:, -1:], past_key_values=cache)  # the tail reaches TAIL_MAX: a round
    assert all(not layer.unscored and layer.store.tail_len == 0 for layer in cache.layers)
    assert all(len(layer.unscored) == TAIL_MAX - 1 for layer in twin.layers)
    assert [_held(layer.store) for layer in cache.layers] == every[-1]
    assert _above_by_entry(cache) == _above_by_entry(reference)


def test_interval_is_an_option_in_the_spec_except_at_1():
    assert policy_spec(get_policy("local_gate"))["options"]["interval"] == 16
    assert "interval" not in policy_spec(get_policy("local_gate", interval=1))["options"]
    with pytest.raises(PolicyError, match="interval"):
        get_policy("local_gate", interval=0)
