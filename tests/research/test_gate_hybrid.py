"""gate_hybrid (experiments/policies/gate_hybrid.py, a research policy outside the package): the
learned gate ranked at a budget (``rank``), or its per-head counts filled by a heuristic's
choice (``select``); with both switches off it is ``attention_gate``. Each test runs with it
registered (``research_policies``), as experiments/research_cli.py registers it."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_mistral_config
from research_fixtures import research_policies  # noqa: F401 - the fixture every test uses

from experiments.policies.gate_hybrid import GateHybrid
from kvgate.cache import CompressedCache
from kvgate.gate import GateConfig, patch, unpatch
from kvgate.models import dispatch
from kvgate.policies import get_policy
from kvgate.policies.attention_gate import AttentionGatePolicy
from kvgate.policies.base import Budget, PolicyError
from kvgate.policies.registry import policy_options

pytestmark = pytest.mark.usefixtures("research_policies")


@pytest.fixture(scope="module")
def model():
    return build(tiny_mistral_config(num_key_value_heads=2))


def _spy_gate(**options):
    """A gate_hybrid policy that records each layer's prompt and keep mask in ``seen``, and
    the prefill band the cache read in ``bands``."""

    class Spy(GateHybrid):
        def keep(self, prompt, budget=None):
            kept = super().keep(prompt, budget)
            self.seen.append((prompt, kept))
            return kept

        def encode_band(self, prompt):
            self.bands.append(super().encode_band(prompt))
            return self.bands[-1]

    spy = Spy(**options)
    spy.seen, spy.bands = [], []
    return spy


def _gated_prefill(model, config, budget, **options):
    """Per-layer keep masks of a left-padded prefill through the cache, and the cache."""
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # 13 real tokens
    torch.manual_seed(0)  # the same random gate weights every time
    patch(model, config)
    try:
        dispatch.install(model)
        spy = _spy_gate(**options)
        cache = CompressedCache(model, spy, budget)
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache)
        return [kept for _, kept in spy.seen], cache, spy
    finally:
        unpatch(model)


@pytest.mark.parametrize("prefill, target", [("gated", "kv"), ("full", "kv"), ("full", "query")])
def test_ranked_gate_keeps_the_budget_per_head_with_its_protected_tokens(model, prefill, target):
    """rank=true keeps exactly ceil(n x ratio) entries of every KV head and row (left padding
    excluded), the sinks and the recent prompt tokens among them, in every layer; also with a
    gate per query head (two per KV head here)."""
    config = GateConfig(gamma=0.0, sinks=2, recent=3, prefill=prefill, target=target)
    keeps, cache, _ = _gated_prefill(model, config, Budget(ratio=0.4), rank=True)
    want = [8, 6]  # ceil(20 x 0.4), ceil(13 x 0.4)
    for layer, kept in enumerate(keeps):
        assert kept.sum(-1).tolist() == [[w] * kept.shape[1] for w in want]
        assert cache.kept_counts(layer).tolist() == [[w] * kept.shape[1] for w in want]
        assert kept[0, :, :2].all() and kept[1, :, 7:9].all()  # the first 2 real tokens
        assert kept[:, :, -3:].all()  # the last 3 prompt tokens
        assert not kept[1, :, :7].any()  # padding


def test_ranked_and_thresholded_gates_keep_nested_sets_of_the_same_scores(model):
    """The ranking reads the scores the threshold reads: in every head the ranked keep set
    and the thresholded one are nested (both are top sets of one score), and budgets nest."""
    config = GateConfig(gamma=0.0, sinks=1)
    flags, _, _ = _gated_prefill(model, config, Budget(ratio=1.0), prefill="full")
    low, _, _ = _gated_prefill(model, config, Budget(ratio=0.3), rank=True, prefill="full")
    high, _, _ = _gated_prefill(model, config, Budget(ratio=0.6), rank=True, prefill="full")
    for f, lo, hi in zip(flags, low, high):
        assert not (lo & ~hi).any()  # a smaller budget keeps a subset
        for ranked in (lo, hi):
            sub = ~(ranked & ~f).flatten(0, 1).any(-1)  # ranked within the flags, per head
            sup = ~(f & ~ranked).flatten(0, 1).any(-1)  # the flags within ranked
            assert bool((sub | sup).all())
    # the random gate is not degenerate: some head keeps a different count than the budget
    assert any(bool((f.sum(-1) != lo.sum(-1)).any()) for f, lo in zip(flags, low))


def test_ranked_gate_needs_a_budget_and_takes_no_tau(model):
    _, _, spy = _gated_prefill(model, GateConfig(gamma=0.0), Budget(ratio=0.5), rank=True)
    prompt, _ = spy.seen[0]
    with pytest.raises(PolicyError, match="rank=true.*budget"):
        spy.keep(prompt, None)
    with pytest.raises(PolicyError, match="tau"):
        get_policy("gate_hybrid", rank=True, tau=0.7)
    with pytest.raises(PolicyError, match="rank"):
        get_policy("gate_hybrid", rank="yes")
    assert get_policy("gate_hybrid").budget_free and not spy.budget_free
    assert get_policy("attention_gate").budget_free


@pytest.mark.parametrize("selector, options", [
    ("h2o", None), ("snapkv", None), ("h2o", {"recent": 1}), ("snapkv", {"window": 2, "kernel": 1}),
])
def test_select_keeps_the_gates_counts_with_the_heuristics_entries(model, selector, options):
    """select=h2o|snapkv: every (row, KV head) keeps as many entries as the thresholded gate,
    and exactly the ones the heuristic keeps at that count (at its defaults, or at
    select_options); with per-query-head gates too."""
    for target in ("kv", "query"):
        config = GateConfig(gamma=0.0, sinks=2, recent=3, prefill="full", target=target)
        flags, _, _ = _gated_prefill(model, config, Budget(ratio=1.0))
        _, cache, spy = _gated_prefill(model, config, Budget(ratio=1.0), select=selector,
                                       select_options=options)
        heuristic = get_policy(selector, **(options or {}))
        some_moved = False
        for layer, ((prompt, kept), f) in enumerate(zip(spy.seen, flags)):
            assert torch.equal(kept.sum(-1), f.sum(-1))
            assert torch.equal(cache.kept_counts(layer), kept.sum(-1))
            for b in range(kept.shape[0]):
                for h in range(kept.shape[1]):
                    count = int(kept[b, h].sum())
                    alone = heuristic.keep(prompt, Budget(tokens=count))
                    assert torch.equal(kept[b, h], alone[b, h]), (layer, b, h)
            some_moved = some_moved or bool((kept != f).any())
        assert some_moved  # the heuristic chose other entries than the gate somewhere
        assert set(spy.bands) == {None} and spy.needs_attention  # a full prefill


def test_select_is_checked():
    with pytest.raises(PolicyError, match="select: must be one of gate, h2o, snapkv"):
        get_policy("gate_hybrid", select="tova")
    with pytest.raises(PolicyError, match="select.*rank"):
        get_policy("gate_hybrid", select="h2o", rank=True)
    with pytest.raises(PolicyError, match="prefill: must be full with select=h2o"):
        get_policy("gate_hybrid", select="h2o", prefill="gated")
    with pytest.raises(PolicyError, match="select_options: needs select=h2o or select=snapkv"):
        get_policy("gate_hybrid", select_options={"recent": 4})
    with pytest.raises(PolicyError, match="select_options: policy 'h2o' has no option 'window'; "
                                          "its options: recent, gqa"):
        get_policy("gate_hybrid", select="h2o", select_options={"window": 4})
    with pytest.raises(PolicyError, match="select_options: must be a mapping"):
        get_policy("gate_hybrid", select="h2o", select_options=32)
    with pytest.raises(PolicyError, match="snapkv.window"):  # the heuristic checks its values
        get_policy("gate_hybrid", select="snapkv", select_options={"window": -1})
    gate = get_policy("gate_hybrid", select="snapkv", tau=0.7)
    assert gate.prefill == "full" and gate.budget_free
    assert not get_policy("gate_hybrid").needs_attention


@pytest.mark.parametrize("config", [
    GateConfig(gamma=0.0, sinks=2, recent=3), GateConfig(gamma=0.0, prefill="full", target="query"),
    GateConfig(gamma=0.0, ungated_layers=1),
])
def test_defaults_are_the_attention_gate(model, config):
    """With rank and select off, gate_hybrid keeps exactly what attention_gate keeps, in every
    layer (the same code: the hybrid subclasses the gate policy)."""
    hybrid, hybrid_cache, _ = _gated_prefill(model, config, Budget(ratio=0.5))

    class GateSpy(AttentionGatePolicy):
        def keep(self, prompt, budget=None):
            kept = super().keep(prompt, budget)
            self.seen.append(kept)
            return kept

    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    torch.manual_seed(0)
    patch(model, config)
    try:
        dispatch.install(model)
        gate = GateSpy()
        gate.seen = []
        cache = CompressedCache(model, gate, Budget(ratio=0.5))
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache)
    finally:
        unpatch(model)
    assert len(gate.seen) == len(hybrid) == model.config.num_hidden_layers
    for a, b in zip(hybrid, gate.seen):
        assert torch.equal(a, b)
    assert hybrid_cache.kept_fractions() == cache.kept_fractions()


def test_options_are_the_gates_plus_the_switches():
    assert policy_options(GateHybrid) == ["tail", "tau", "prefill", "rank", "select",
                                          "select_options"]
    assert policy_options(AttentionGatePolicy) == ["tail", "tau", "prefill"]
    for bad in ({"rank": True}, {"select": "h2o"}, {"select_options": {}}):
        with pytest.raises(PolicyError, match="has no option"):
            get_policy("attention_gate", **bad)
    with pytest.raises(PolicyError, match="gate_hybrid.tail"):
        get_policy("gate_hybrid", tail=-1)
