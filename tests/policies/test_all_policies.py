"""One matrix over every registered heuristic policy on random q/k/v (tie-free inputs)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from policy_testing import decode_inputs, make_prompt, sample

from kvgate.policies import POLICIES, Budget, PolicyError, get_policy, list_policies
from kvgate.policies.base import LayerPrompt
from kvgate.policies.contract import (
    DecodeEvicting,
    EncodeMasking,
    Policy,
    StreamingPrefill,
    prefill_band,
)
from kvgate.policies.registry import policy_options, policy_spec

# small windows so that a 24-token prompt really exercises selection
OPTIONS = {
    "full": {},
    "window": {},
    "random": {"seed": 3},
    "streaming": {},
    "h2o": {},
    "tova": {},
    "snapkv": {"window": 4, "kernel": 3},
    "pyramidkv": {"window": 4, "kernel": 3},
    "adakv": {"inner_options": {"window": 4, "kernel": 3}, "exact": True},
    "nacl": {"proxy": 4, "sinks": 2, "protect": 2, "random_share": 0.4},
    "roco": {"sinks": 2, "protect_last": 3, "block": 3},
    "ahakv": {"recent": 4, "kernel": 3},
    "knorm": {},
}
# need a gated model (tests/cache, tests/gate/test_kinds, tests/research/test_gate_hybrid)
LEARNED = {"attention_gate", "local_gate", "gate_rank"}
NAMES = [name for name in POLICIES if name not in LEARNED]
DECODE = [name for name in NAMES if issubclass(POLICIES[name], DecodeEvicting)]


def build(name: str):
    """A registered policy with the matrix's small options (its defaults if it has none)."""
    return get_policy(name, **OPTIONS.get(name, {}))


def test_the_matrix_covers_every_registered_heuristic():
    # a new policy joins the matrix from the registry (at its defaults unless listed above)
    assert set(NAMES) == set(POLICIES) - LEARNED and "knorm" in NAMES
    assert set(OPTIONS) <= set(NAMES), "OPTIONS names a policy that is not registered"
    assert list_policies() == list(POLICIES)


@pytest.mark.parametrize("name", NAMES)
def test_defaults_construct_and_keep(name):
    keep = get_policy(name).keep(make_prompt(lengths=(40, 33)), Budget(tokens=12))
    assert keep.shape == (2, 2, 40) and keep.dtype == torch.bool


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [Budget(tokens=9), Budget(ratio=0.4),
                                    Budget(ratio=0.3, rounding="nearest")])
def test_shape_padding_and_count(name, budget):
    prompt = make_prompt()
    policy = build(name)
    keep = policy.keep(prompt, budget)
    assert keep.shape == (2, 2, 24) and keep.dtype == torch.bool
    assert not keep[~prompt.valid[:, None, :].expand_as(keep)].any(), "padding kept"
    want = budget.per_sample(prompt.n_real)
    counts = keep.sum(-1)
    if name == "full":
        assert torch.equal(counts, prompt.n_real[:, None].expand_as(counts))
    elif name == "adakv":  # head-varying by design: the per-layer total is exact
        assert torch.equal(counts.sum(-1), want * keep.shape[1])
    elif name == "pyramidkv":  # the layer's own budget (layer 1 of 4: above the average)
        layer = policy.layer_budget(prompt, want)
        assert (layer >= want).all() and (layer > want).any()
        assert torch.equal(counts, layer[:, None].expand_as(counts))
    else:
        assert torch.equal(counts, want[:, None].expand_as(counts))


def test_ratio_rounding_up_or_to_the_nearest_token():
    n = torch.tensor([8, 24, 17, 10])
    # 8 x 0.78 = 6.24, 24 x 0.3 = 7.2 (17 x 0.3 = 5.1), 10 x 0.55 = 5.5
    assert Budget(ratio=0.78).per_sample(n[:1]).tolist() == [7]
    assert Budget(ratio=0.78, rounding="nearest").per_sample(n[:1]).tolist() == [6]
    assert Budget(ratio=0.3).per_sample(n[1:3]).tolist() == [8, 6]
    assert Budget(ratio=0.3, rounding="nearest").per_sample(n[1:3]).tolist() == [7, 5]
    assert Budget(ratio=0.55, rounding="nearest").per_sample(n[3:]).tolist() == [6]
    assert Budget(ratio=0.01, rounding="nearest").per_sample(n[:1]).tolist() == [1]  # >= 1
    with pytest.raises(PolicyError, match="rounding must be one of up, nearest"):
        Budget(ratio=0.5, rounding="down")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [Budget(ratio=1.0), Budget(tokens=500), Budget(tokens=24)])
def test_budget_at_or_above_length_keeps_everything(name, budget):
    prompt = make_prompt()
    keep = build(name).keep(prompt, budget)
    assert torch.equal(keep, prompt.valid[:, None, :].expand_as(keep))


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_batch_equals_one_by_one(name):
    prompt = make_prompt(lengths=(24, 17, 11))
    policy = build(name)
    for budget in (Budget(tokens=8), Budget(ratio=0.5)):
        batched = policy.keep(prompt, budget)
        for i in range(3):
            alone = policy.keep(sample(prompt, i), budget)[0]
            n_real = alone.shape[-1]
            assert torch.equal(batched[i, :, -n_real:], alone), (name, budget, i)


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_inputs(name):
    prompt = make_prompt(dtype=torch.bfloat16)
    keep = build(name).keep(prompt, Budget(tokens=9))
    assert keep.dtype == torch.bool
    assert not (keep & ~prompt.valid[:, None, :]).any()
    if name not in ("full", "pyramidkv"):
        assert (keep.sum(-1).sum(-1) == 18).all()


@pytest.mark.parametrize("name", NAMES)
def test_bad_prompt_shapes_raise_policy_error(name):
    prompt = make_prompt()
    bad = LayerPrompt(layer_idx=0, num_layers=4, query=prompt.query[:, :3], key=prompt.key,
                      value=prompt.value, valid=prompt.valid, scaling=prompt.scaling)
    with pytest.raises(PolicyError):
        build(name).keep(bad, Budget(tokens=5))


@pytest.mark.parametrize("name", DECODE)
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_select_invariants(name, rows):
    policy = build(name)
    logits, valid, positions = decode_inputs(rows=rows)
    capacity = torch.tensor([[5, 5], [7, 30]])
    stats = {key: torch.rand(valid.shape) for key in ("acc", "acc2", "cnt", "score")}
    stats["lam"] = torch.ones(valid.shape)
    new, keep = policy.decode_select(stats, logits, valid, positions, capacity)
    assert keep.shape == valid.shape and keep.dtype == torch.bool
    assert not (keep & ~valid).any()
    assert torch.equal(keep.sum(-1), torch.minimum(capacity, valid.sum(-1)))
    for value in new.values():
        assert value.shape == valid.shape and torch.isfinite(value).all()


@pytest.mark.parametrize("name", DECODE)
def test_decode_init_stats_cover_the_prompt(name):
    policy = build(name)
    prompt = make_prompt()
    keep = policy.keep(prompt, Budget(tokens=9))
    stats = policy.decode_init(prompt, keep)
    assert isinstance(stats, dict)
    for value in stats.values():
        assert value.shape == (2, 2, 24) and value.dtype == torch.float32
        assert torch.isfinite(value).all()


@pytest.mark.parametrize("name", DECODE)
def test_decode_select_accepts_an_empty_stats_dict(name):
    logits, valid, positions = decode_inputs()
    _, keep = build(name).decode_select({}, logits, valid, positions, torch.full((2, 2), 4))
    assert torch.equal(keep.sum(-1), torch.minimum(torch.full((2, 2), 4), valid.sum(-1)))


@pytest.mark.parametrize("name", DECODE)
def test_decode_select_rejects_mismatched_shapes(name):
    logits, valid, positions = decode_inputs()
    with pytest.raises(PolicyError, match="capacity"):
        build(name).decode_select({}, logits, valid, positions, torch.full((2,), 4))
    with pytest.raises(PolicyError, match="positions"):
        build(name).decode_select({}, logits, valid, positions[..., :-1], torch.full((2, 2), 4))


def test_registry_errors_name_the_problem():
    with pytest.raises(PolicyError, match=r"unknown policy 'nope'; known: full, window"):
        get_policy("nope")
    with pytest.raises(PolicyError, match="no option 'windw'.*window"):
        get_policy("snapkv", windw=3)
    with pytest.raises(PolicyError, match="snapkv.kernel"):
        get_policy("snapkv", kernel=4)
    with pytest.raises(PolicyError, match="h2o.gqa"):
        get_policy("h2o", gqa="median")
    assert type(get_policy("SnapKV")).__name__ == "SnapKV"


@pytest.mark.parametrize("name", list_policies())
def test_every_policy_has_a_json_spec_that_tells_options_apart(name):
    spec = policy_spec(get_policy(name))
    assert json.loads(json.dumps(spec)) == spec and spec["policy"] == name
    # options added after specs were stored (``allocation``, local_gate's ``threshold``) are
    # written only away from their default, so the specs of results stored before still match
    later = {f.name for f in dataclasses.fields(get_policy(name))
             if f.metadata.get("omit_default")}
    assert set(spec["options"]) == set(policy_options(type(get_policy(name)))) - later
    if "allocation" in policy_options(type(get_policy(name))) and name != "pyramidkv":
        spec = policy_spec(get_policy(name, allocation="global"))
        assert spec["options"]["allocation"] == "global"


def test_spec_of_a_nested_policy_and_of_changed_options():
    ada = policy_spec(get_policy("adakv", inner="h2o"))
    assert ada["options"]["inner"]["policy"] == "h2o"
    assert policy_spec(get_policy("snapkv", window=4)) != policy_spec(get_policy("snapkv"))


def test_learned_policies_are_registered():
    assert {"attention_gate", "local_gate", "knorm"} <= set(list_policies())
    assert type(get_policy("Attention_Gate")).__name__ == "AttentionGatePolicy"
    # the research hybrids live in experiments/policies, registered only where they are run
    assert "gate_hybrid" not in list_policies()


def test_outside_code_registers_a_policy_by_name_and_a_bad_one_is_refused(monkeypatch):
    from kvgate.policies import registry
    from kvgate.policies.knorm import KNorm

    monkeypatch.setattr(registry, "POLICIES", dict(registry.POLICIES))

    class Outside(KNorm):
        name = "outside_knorm"

    registry.register_policy("outside_knorm", Outside)
    registry.register_policy("outside_knorm", Outside)  # again: nothing changes
    assert "outside_knorm" in registry.list_policies()
    assert isinstance(registry.get_policy("outside_knorm"), Outside)
    for name, cls, says in [("knorm", Outside, "must agree"), ("Outside_Knorm", Outside,
                            "lower-case identifier"), ("outside_knorm", int, "not a Policy"),
                            ("snapkv", registry.POLICIES["knorm"], "must agree")]:
        with pytest.raises(PolicyError, match=says):
            registry.register_policy(name, cls)

    class Taken(KNorm):
        name = "outside_knorm"

    with pytest.raises(PolicyError, match="'outside_knorm' is taken by Outside"):
        registry.register_policy("outside_knorm", Taken)


def test_declared_contracts():
    """Each extension of the one-shot contract is declared by the class, not probed."""
    assert set(DECODE) == {"window", "streaming", "h2o", "tova", "roco", "ahakv"}
    assert all(issubclass(cls, Policy) for cls in POLICIES.values())
    assert [n for n, cls in POLICIES.items() if issubclass(cls, StreamingPrefill)] == ["roco"]
    assert POLICIES["roco"]().block >= 1
    assert {n for n, cls in POLICIES.items() if issubclass(cls, EncodeMasking)} == LEARNED - {
        "gate_rank"}  # it ranks after a full prefill
    assert {n for n, cls in POLICIES.items() if cls.needs_gate} == LEARNED  # what runs on gates
    prompt = make_prompt()
    assert all(prefill_band(build(name), prompt) is None for name in NAMES)
    assert not any(build(name).encode_mask for name in NAMES)


@pytest.mark.parametrize("trained, option, band", [("gated", None, 3), ("full", None, None),
                                                   ("gated", "full", None), ("full", "gated", 3)])
def test_the_gates_prefill_band_comes_from_its_layer_not_from_state(trained, option, band):
    """The learned gate encodes under eq. 5 with its trained band unless it or its run says
    ``prefill="full"``; read from the prompt's layer each time, nothing kept on the policy."""
    from types import SimpleNamespace

    from kvgate.gate import GateConfig

    gate = SimpleNamespace(config=GateConfig(recent=3, prefill=trained, rope=False))
    prompt = make_prompt()
    prompt.module, prompt.hidden = SimpleNamespace(kv_gate=gate), prompt.query[:, 0]
    policy = get_policy("attention_gate", prefill=option)
    before = dict(vars(policy))
    assert prefill_band(policy, prompt) == band
    assert vars(policy) == before


def test_a_decode_policy_must_define_both_hooks():
    class Half(DecodeEvicting):
        name = "half"

        def keep(self, prompt, budget):
            return prompt.valid[:, None, :]

        def decode_init(self, prompt, keep):
            return {}

    with pytest.raises(TypeError, match="decode_select"):
        Half()


@pytest.mark.parametrize("name", DECODE)
def test_decode_select_takes_the_prefill_flag(name):
    """Every decode-evicting policy accepts ``prefill`` (the cache always passes it); only a
    streamed prefill's rounds differ from decoding ones (RoCo's encoding ratio)."""
    logits, valid, positions = decode_inputs()
    capacity = torch.full((2, 2), 4)
    _, keep = build(name).decode_select({}, logits, valid, positions, capacity)
    _, again = build(name).decode_select({}, logits, valid, positions, capacity, prefill=True)
    assert keep.shape == again.shape
    if name != "roco":
        assert torch.equal(keep, again)
