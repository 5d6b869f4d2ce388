"""Every registered heuristic policy through the real cache: it shrinks, holds decode
capacity, and (deterministic policies) gives the same tokens batched as one by one."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_mistral_config

from kvgate.cache import CompressedCache
from kvgate.policies import get_policy, list_policies
from kvgate.policies.base import Budget

HEURISTICS = [name for name in list_policies() if name != "attention_gate"]
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
    if policy.decode_eviction:
        for layer in range(model.config.num_hidden_layers):
            held = cache.kept_counts(layer)
            assert torch.equal(held, cache.layers[layer].capacity)
    if name in RANDOMISED:
        return
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], past_key_values=CompressedCache(
            model, _policy(name), Budget(ratio=0.5)), **gen)[:, len(p):]
        assert batched[i].tolist() == alone[0].tolist(), f"sample {i}"


@pytest.mark.parametrize("protected", [{}, {"sinks": 2, "recent": 3}])
def test_attention_gate_prefill_equals_the_gated_model(model, protected):
    """The learned policy through the cache (eq. 5 prefill + compaction) gives the logits of
    the gated model's own masked forward, and generation continues from the kept entries;
    also with protected sinks and a recent band (training and prefill must agree)."""
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
