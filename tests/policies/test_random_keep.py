import torch
from policy_testing import kept_positions, make_prompt

from kvgate.policies import Budget, RandomKeep, get_policy


def test_keeps_exactly_the_budget_and_only_real_tokens():
    prompt = make_prompt(lengths=(20, 9))
    keep = RandomKeep().keep(prompt, Budget(tokens=6))
    assert keep.sum(-1).tolist() == [[6, 6], [6, 6]]
    assert all(p >= 11 for h in range(2) for p in kept_positions(keep, 1, h))  # left padding


def test_draw_depends_on_seed_and_layer_and_is_reproducible():
    prompt = make_prompt(lengths=(40,), layer_idx=1)
    a = RandomKeep(seed=0).keep(prompt, Budget(ratio=0.5))
    assert torch.equal(a, RandomKeep(seed=0).keep(prompt, Budget(ratio=0.5)))
    assert not torch.equal(a, RandomKeep(seed=1).keep(prompt, Budget(ratio=0.5)))
    other_layer = make_prompt(lengths=(40,), layer_idx=2)
    assert not torch.equal(a, RandomKeep(seed=0).keep(other_layer, Budget(ratio=0.5)))
    assert not torch.equal(a[:, 0], a[:, 1])  # heads draw independently


def test_kept_positions_are_spread_uniformly():
    """Over many layers every position is kept about budget/n of the time: no recency bias."""
    hits = torch.zeros(64)
    for layer in range(200):
        prompt = make_prompt(lengths=(64,), layer_idx=layer % 4, num_layers=4)
        keep = RandomKeep(seed=layer).keep(prompt, Budget(ratio=0.25))
        hits += keep[0].float().sum(0)
    share = hits / (200 * 2)
    assert share[:32].mean().sub(share[32:].mean()).abs() < 0.03
    assert share.min() > 0.1 and share.max() < 0.4


def test_registered_by_name():
    assert isinstance(get_policy("random", seed=2), RandomKeep)
