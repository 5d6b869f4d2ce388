"""Every registered heuristic policy through the real cache: it shrinks, holds decode
capacity, and (deterministic policies) gives the same tokens batched as one by one."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_mistral_config

from kvgate.cache import CompressedCache
from kvgate.policies import PassScoring, get_policy, list_policies, policy_class
from kvgate.policies.base import Budget, DecodeEvicting

# need a gated model: tested below, in tests/policies and tests/gate/test_kinds.py; a PassScoring
# policy (kvzip) needs its extra passes, which model.generate does not run:
# tests/policies/test_kvzip.py runs it through the engine
LEARNED = {"attention_gate", "local_gate", "gate_rank"}
HEURISTICS = [name for name in list_policies()
              if name not in LEARNED and not issubclass(policy_class(name), PassScoring)]
# random eviction draws per batch row, so a batch need not equal its rows run alone
RANDOMISED = {"nacl"}
SMALL = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}, "adakv": {"inner_options": {"window": 4}},
         "ahakv": {"recent": 4}, "h2o": {"recent": 0.5}, "roco": {"block": 4}}


@pytest.fixture(scope="module")
def model():
    return build(tiny_mistral_config(num_key_value_heads=2))


def _policy(name):
    return get_policy(name, **SMALL.get(name, {}))


@pytest.mark.parametrize("name", HEURISTICS)
def test_policy_through_cache(model, name):
    prompts = [torch.randint(1, 128, (k,), generator=torch.Generator().manual_seed(k))
               for k in (24, 15)]
    n = 24
    ids = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):], mask[i, n - len(p):] = p, 1
    gen = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    policy = _policy(name)
    cache = CompressedCache(model, policy, Budget(ratio=0.5))
    batched = model.generate(ids, attention_mask=mask, past_key_values=cache, **gen)[:, n:]
    if name != "full":
        assert cache.kept_fraction() < 0.85
        assert cache.bytes_held() < 0.85 * cache.full_bytes()
    if isinstance(policy, DecodeEvicting):
        for layer in range(model.config.num_hidden_layers):
            held = cache.kept_counts(layer)
            assert torch.equal(held, cache.layers[layer].capacity)
    if name in RANDOMISED:
        return
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], past_key_values=CompressedCache(
            model, _policy(name), Budget(ratio=0.5)), **gen)[:, len(p):]
        assert batched[i].tolist() == alone[0].tolist(), f"sample {i}"


@pytest.mark.parametrize("protected", [{}, {"sinks": 2, "recent": 3}, {"rope": False}])
def test_attention_gate_prefill_equals_the_gated_model(model, protected):
    """The learned policy through the cache (eq. 5 prefill + compaction) gives the logits of
    the gated model's own masked forward, and generation continues from the kept entries;
    also with protected sinks and a recent band (training and prefill must agree) and without
    rotary positions in the gate."""
    from kvgate.gate import GateConfig, patch, unpatch
    from kvgate.models import dispatch

    patch(model, GateConfig(gamma=0.0, tau=0.5, **protected))  # random gates: real eviction
    try:
        dispatch.install(model)
        ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = CompressedCache(model, get_policy("attention_gate"), Budget(ratio=1.0))
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, position_ids=pos).logits
            got = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
        valid = mask.bool()
        torch.testing.assert_close(got[valid], ref[valid], atol=1e-4, rtol=0)
        assert 0.05 < cache.kept_fraction() < 0.95
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             pad_token_id=0, past_key_values=CompressedCache(
                                 model, get_policy("attention_gate"), Budget(ratio=1.0)))
        assert out.shape == (2, 23)
    finally:
        unpatch(model)


@pytest.mark.parametrize("tail, want", [(5, [5, 5]), (0.25, [5, 3]), (0, [0, 0])])
def test_attention_gate_tail_keeps_the_last_prompt_tokens(model, tail, want):
    """With gates that evict everything (tau 0.999), the cache holds exactly the tail: an int
    count, or a share of each row's own (left-padded) length."""
    from kvgate.gate import GateConfig, patch, unpatch
    from kvgate.models import dispatch

    patch(model, GateConfig(gamma=0.0, tau=0.999))
    try:
        dispatch.install(model)
        ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :6] = 0  # 14 real tokens: a 0.25 share is 3
        cache = CompressedCache(model, get_policy("attention_gate", tail=tail), Budget(ratio=1.0))
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache)
        for layer in range(model.config.num_hidden_layers):
            held = cache.kept_counts(layer)
            assert held.tolist() == [[w] * held.shape[1] for w in want]
    finally:
        unpatch(model)


@pytest.mark.parametrize("bad", [-1, 1.5, "end"])
def test_attention_gate_tail_is_checked(bad):
    from kvgate.policies.base import PolicyError

    with pytest.raises(PolicyError, match="tail"):
        get_policy("attention_gate", tail=bad)


def test_attention_gate_tau_dials_eviction_and_equals_a_gate_trained_at_it(model):
    """An inference tau evicts monotonically more as it rises, and the cache it leaves is the
    one a gate configured with that tau leaves (same weights)."""
    from kvgate.gate import GateConfig, patch, unpatch
    from kvgate.models import dispatch

    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def kept(config_tau, policy_tau):
        torch.manual_seed(0)  # the same random gate weights every time
        patch(model, GateConfig(gamma=0.0, tau=config_tau))
        try:
            dispatch.install(model)
            cache = CompressedCache(model, get_policy("attention_gate", tau=policy_tau),
                                    Budget(ratio=1.0))
            with torch.no_grad():
                model(ids, attention_mask=mask, past_key_values=cache)
            return [cache.kept_counts(layer) for layer in range(model.config.num_hidden_layers)]
        finally:
            unpatch(model)

    fractions = [sum(int(c.sum()) for c in kept(0.5, tau)) for tau in (0.2, 0.5, 0.8)]
    assert fractions[0] > fractions[1] > fractions[2]
    for a, b in zip(kept(0.5, 0.7), kept(0.7, None)):
        assert torch.equal(a, b)


def test_attention_gate_full_prefill_encodes_like_the_full_cache(model):
    """prefill="full": the prompt is encoded with full attention (prefill logits equal the full
    cache's), the cache then holds the gate's flags (layer 0 sees the same input either way, so
    it keeps what the in-prefill gate keeps), and decoding reads the compressed cache."""
    from kvgate.gate import GateConfig, patch, unpatch
    from kvgate.models import dispatch

    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    patch(model, GateConfig(gamma=0.0))
    try:
        dispatch.install(model)

        def prefill(policy):
            cache = CompressedCache(model, policy, Budget(ratio=1.0))
            with torch.no_grad():
                logits = model(ids, attention_mask=mask, past_key_values=cache).logits
            return logits, cache

        full_logits, full_cache = prefill(get_policy("full"))
        one_logits, one_cache = prefill(get_policy("attention_gate", prefill="full"))
        gated_logits, gated_cache = prefill(get_policy("attention_gate"))
    finally:
        unpatch(model)
    torch.testing.assert_close(one_logits, full_logits)
    assert (gated_logits - full_logits).abs().max() > 1e-3  # in-prefill eviction changes them
    assert torch.equal(one_cache.kept_counts(0), gated_cache.kept_counts(0))
    assert int(one_cache.kept_counts(0).sum()) < int(full_cache.kept_counts(0).sum())


def test_attention_gate_prefill_is_checked():
    from kvgate.policies.base import PolicyError

    with pytest.raises(PolicyError, match="prefill.*gated, full"):
        get_policy("attention_gate", prefill="eager")


@pytest.mark.parametrize("bad", [0, 1, 1.5, True, "high"])
def test_attention_gate_tau_is_checked(bad):
    from kvgate.policies.base import PolicyError

    with pytest.raises(PolicyError, match="tau"):
        get_policy("attention_gate", tau=bad)
