import pytest
import torch
from policy_testing import kept_positions, make_prompt

from kvgate.policies import Budget, NaCl, PolicyError

SPEC = {"sinks": 2, "protect": 2, "random_share": 0.25, "proxy": 3}  # B=9: C_r=2, C_p=3


def test_spec_split_n20():
    policy, prompt = NaCl(**SPEC), make_prompt(lengths=(20,))
    sinks, protect, top, rand = policy.split(torch.tensor([9]), torch.tensor([20]))
    assert [int(x) for x in (sinks, protect, top, rand)] == [2, 2, 3, 2]
    keep = policy.keep(prompt, Budget(tokens=9))
    assert (keep.sum(-1) == 9).all()
    for h in range(2):
        assert {0, 1, 18, 19} <= kept_positions(keep, 0, h)


def test_random_set_is_disjoint_from_the_proxy_top_set():
    prompt = make_prompt(lengths=(20,))
    scores = NaCl(**SPEC).scores(prompt)[0]
    for seed in range(5):
        keep = NaCl(**SPEC, seed=seed).keep(prompt, Budget(tokens=9))[0]
        for h in range(2):
            middle = set(range(2, 18))
            chosen = sorted(kept_positions(keep[None], 0, h) & middle)
            top3 = set(scores[h, 2:18].topk(3).indices.add(2).tolist())
            assert top3 <= set(chosen) and len(chosen) == 5  # 3 top + 2 random, disjoint


def test_no_random_share_is_deterministic_top_proxy():
    prompt = make_prompt(lengths=(20,))
    options = dict(SPEC, random_share=0.0)
    a = NaCl(**options, seed=1).keep(prompt, Budget(tokens=9))
    b = NaCl(**options, seed=2).keep(prompt, Budget(tokens=9))
    assert torch.equal(a, b)
    scores = NaCl(**options).scores(prompt)[0]
    for h in range(2):
        top5 = set(scores[h, 2:18].topk(5).indices.add(2).tolist())
        assert kept_positions(a, 0, h) == {0, 1, 18, 19} | top5


def test_seeding_same_seed_same_set_other_heads_layers_seeds_differ():
    prompt = make_prompt(lengths=(60,), heads=8, kv_heads=8)
    options = dict(SPEC, random_share=0.5)
    a = NaCl(**options, seed=3).keep(prompt, Budget(tokens=20))
    assert torch.equal(a, NaCl(**options, seed=3).keep(prompt, Budget(tokens=20)))
    assert not torch.equal(a, NaCl(**options, seed=4).keep(prompt, Budget(tokens=20)))
    assert len({tuple(a[0, h].tolist()) for h in range(8)}) > 1
    other_layer = make_prompt(lengths=(60,), heads=8, kv_heads=8, layer_idx=2)
    assert not torch.equal(a, NaCl(**options, seed=3).keep(other_layer, Budget(tokens=20)))


class FixedScores(NaCl):
    def scores(self, prompt, budget=None):
        n = prompt.key.shape[2]
        return torch.linspace(0.0, 2.0, n).expand(prompt.key.shape[:3])


def test_sampling_frequency_is_monotone_in_the_score():
    prompt = make_prompt(lengths=(8,), heads=64, kv_heads=64)
    counts = torch.zeros(8)
    for seed in range(50):
        policy = FixedScores(sinks=0, protect=0, random_share=1.0, seed=seed)
        counts += policy.keep(prompt, Budget(tokens=2))[0].sum(0)
    assert counts.sum() == 50 * 64 * 2
    assert torch.equal(counts.argsort(), torch.arange(8)), counts


def test_options_are_validated():
    with pytest.raises(PolicyError, match="nacl.random_share"):
        NaCl(random_share=1.2)
    with pytest.raises(PolicyError, match="nacl.proxy"):
        NaCl(proxy=-1)
    with pytest.raises(PolicyError, match="nacl.seed"):
        NaCl(seed=-3)
