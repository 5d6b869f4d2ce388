"""What a policy derives from a LayerPrompt is reused within that prompt and never leaks into a
copy of other rows or a prefix (H2O computes its column sums once per layer call)."""

from dataclasses import replace

import torch

from kvgate.policies.base import attention_sums
from kvgate.policies.contract import LayerPrompt
from kvgate.policies.h2o import H2O


def _prompt(b=2, n=7):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, n, 8, generator=gen)
    k = torch.randn(b, 2, n, 8, generator=gen)
    return LayerPrompt(0, 1, q, k, k.clone(), torch.ones(b, n, dtype=torch.bool), 0.35)


def test_h2o_sums_once_per_prompt_and_fresh_in_copies(monkeypatch):
    prompt = _prompt()
    calls = []
    import kvgate.policies.h2o as h2o_mod

    monkeypatch.setattr(h2o_mod, "attention_sums",
                        lambda *a, **kw: calls.append(1) or attention_sums(*a, **kw))
    first = H2O().scores(prompt)
    again = H2O().scores(prompt)
    assert len(calls) == 1 and torch.equal(first, again)
    one_row = replace(prompt, query=prompt.query[1:], key=prompt.key[1:],
                      value=prompt.value[1:], valid=prompt.valid[1:])
    assert torch.allclose(H2O().scores(one_row), first[1:], atol=1e-6)
    assert H2O().scores(prompt.head(4)).shape == (2, 2, 4)
    assert len(calls) == 3


def _reference_lse(prompt):
    """Each row's log-sum-exp of its causal, scaled logits over real keys ([B, H, n])."""
    g = prompt.group
    k = prompt.key.repeat_interleave(g, 1)
    s = prompt.query @ k.transpose(-1, -2) * prompt.scaling
    n = s.shape[-1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & prompt.valid[:, None, :]
    return torch.logsumexp(s.masked_fill(~allowed[:, None], float("-inf")), dim=-1)


def test_sums_from_the_log_sum_exp_equal_the_softmax_sums():
    """Given each row's log-sum-exp (the fused prefill's), the column sums, their squares, a
    row subset and row weights come out as the softmax formula's; padding rows and columns
    contribute nothing."""
    prompt = _prompt(n=40)
    prompt.valid[1, :9] = False  # a left-padded row
    lse = _reference_lse(prompt)
    weight = torch.rand(2, 40, generator=torch.Generator().manual_seed(1))
    for kw in ({}, {"first_row": 25}, {"row_weight": weight}, {"squares": True}):
        args = (prompt.query, prompt.key, prompt.valid, prompt.scaling)
        want, got = attention_sums(*args, **kw), attention_sums(*args, **kw, lse=lse)
        for w, g in zip(*((want, got) if kw.get("squares") else ((want,), (got,)))):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert attention_sums(*args, lse=lse)[1, :, :9].abs().max() == 0


def test_h2o_in_the_cache_reads_the_sums_of_the_prefills_own_pass(monkeypatch):
    """An unpadded CPU prefill hands H2O the column sums of its own one-pass attention (no
    second pass over q.k: ``attention_sums`` is not called); a padded batch computes them
    with the softmax formula. Either way the cache keeps what the softmax formula keeps."""
    from conftest import build, tiny_llama_config

    import kvgate.policies.h2o as h2o_mod
    from kvgate.cache import CompressedCache

    model = build(tiny_llama_config())
    seen = []
    monkeypatch.setattr(h2o_mod, "attention_sums", lambda *a, lse=None, **kw: seen.append(
        lse is not None) or attention_sums(*a, **kw, lse=lse))
    ids = torch.randint(1, 100, (2, 30), generator=torch.Generator().manual_seed(3))
    for mask in (torch.ones_like(ids), torch.ones_like(ids).index_fill_(1, torch.arange(4), 0)
                 .index_fill_(0, torch.tensor([0]), 1)):
        seen.clear()
        fast = CompressedCache(model, H2O(), 0.5)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=fast,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        monkeypatch.setattr(h2o_mod, "attention_sums", lambda *a, lse=None, **kw:
                            attention_sums(*a, **kw))
        slow = CompressedCache(model, H2O(), 0.5)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=slow,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        assert set(seen) == (set() if bool(mask.all()) else {False})
        for a, b in zip(fast.layers, slow.layers):
            assert torch.equal(a.store.slot_positions(), b.store.slot_positions())
        monkeypatch.setattr(h2o_mod, "attention_sums", lambda *a, lse=None, **kw: seen.append(
            lse is not None) or attention_sums(*a, **kw, lse=lse))
