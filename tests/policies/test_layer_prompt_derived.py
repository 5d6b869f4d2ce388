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
