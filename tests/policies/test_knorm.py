"""KNorm keeps exactly the budget's lowest-L2-norm keys of every KV head (kvpress's KnormPress)."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config
from policy_testing import make_prompt

from kvgate.cache import CompressedCache
from kvgate.policies import Budget, KNorm, get_policy


def brute_force(key: torch.Tensor, valid: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, n] bool: per (row, KV head), the ``kept[b]`` real keys of lowest norm."""
    b, hk, n, _ = key.shape
    out = torch.zeros(b, hk, n, dtype=torch.bool)
    for i in range(b):  # a reference, written the slow way on purpose
        real = valid[i].nonzero().flatten()
        for h in range(hk):
            norms = key[i, h, real].float().norm(dim=-1)
            out[i, h, real[torch.argsort(norms, stable=True)[: int(kept[i])]]] = True
    return out


@pytest.mark.parametrize("budget", [Budget(tokens=5), Budget(ratio=0.3),
                                    Budget(ratio=0.5, rounding="nearest"), Budget(tokens=1)])
def test_keeps_the_lowest_norm_keys_per_kv_head(budget):
    # GQA (8 query heads over 2 KV heads) and left padding; padding keys are zero, the lowest
    # norm there is, so a policy that looked at padding would keep it
    prompt = make_prompt(lengths=(24, 17, 9), heads=8, kv_heads=2, seed=3)
    prompt.key[~prompt.valid[:, None, :].expand(-1, 2, -1)] = 0.0
    keep = get_policy("knorm").keep(prompt, budget)
    want = brute_force(prompt.key, prompt.valid, budget.per_sample(prompt.n_real))
    assert torch.equal(keep, want)
    assert not (keep & ~prompt.valid[:, None, :]).any(), "padding kept"
    counts = budget.per_sample(prompt.n_real)[:, None].expand(-1, 2)
    assert torch.equal(keep.sum(-1), counts)
    assert not torch.equal(keep[:, 0], keep[:, 1])  # each KV head ranks its own keys


def test_reads_only_the_keys():
    """No attention: queries and values do not change the choice (needs_attention False)."""
    prompt = make_prompt(seed=1)
    other = make_prompt(seed=2)
    other.key = prompt.key
    policy = KNorm()
    assert not policy.needs_attention
    assert torch.equal(policy.keep(prompt, Budget(tokens=6)), policy.keep(other, Budget(tokens=6)))
    assert torch.equal(policy.keep(prompt, Budget(tokens=99)),
                       prompt.valid[:, None, :].expand(-1, 2, -1))


def test_through_the_cache_on_a_tiny_llama():
    """A left-padded batch through CompressedCache: every layer stores exactly the keys of
    lowest norm of each KV head (their positions and key values), on a backend without
    attention scores, and generation runs on from that cache."""
    model = build(tiny_llama_config())
    seen = []

    class Spy(KNorm):
        def keep(self, prompt, budget):
            seen.append((prompt.key.clone(), prompt.valid.clone()))
            return super().keep(prompt, budget)

    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # 14 real tokens
    budget = Budget(ratio=0.4)
    cache = CompressedCache(model, Spy(), budget, allow_attention_scores=False)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    assert len(seen) == model.config.num_hidden_layers
    for layer, (key, valid) in enumerate(seen):
        kept = budget.per_sample(valid.sum(-1))  # 8 of 20, 6 of 14
        want = brute_force(key, valid, kept)
        assert torch.equal(cache.kept_counts(layer), kept[:, None].expand(-1, 2))
        store = cache.layers[layer].store
        stored_k, _ = store.base_kv()
        slots = store.base_slot_valid()
        positions = store.slot_positions()[..., : stored_k.shape[2]]
        real_pos = valid.long().cumsum(-1) - 1  # a token's position among the real ones
        for b in range(2):
            for h in range(2):
                idx = want[b, h].nonzero().flatten()
                pos = positions[b, h][slots[b, h]]
                assert torch.equal(pos.sort().values, real_pos[b, idx])
                torch.testing.assert_close(stored_k[b, h][slots[b, h]][pos.argsort()],
                                           key[b, h, idx])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                         pad_token_id=0, past_key_values=CompressedCache(model, KNorm(), budget))
    assert out.shape == (2, 23)
