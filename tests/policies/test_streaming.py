import pytest
import torch
from policy_testing import kept_positions, make_prompt

from kvgate.policies import Budget, PolicyError, Streaming


def test_spec_hand_check_n10_b6():
    prompt = make_prompt(lengths=(10,))
    assert kept_positions(Streaming().keep(prompt, Budget(tokens=6))) == {0, 1, 2, 3, 8, 9}


def test_sinks_follow_the_real_start_under_left_padding():
    prompt = make_prompt(lengths=(16, 10))
    keep = Streaming().keep(prompt, Budget(tokens=6))
    assert kept_positions(keep, 1, 1) == {6, 7, 8, 9, 14, 15}


def test_budget_below_the_sinks_keeps_the_first_tokens():
    prompt = make_prompt(lengths=(10,))
    assert kept_positions(Streaming().keep(prompt, Budget(tokens=3))) == {0, 1, 2}


def test_factory_variant_keeps_the_first_b_minus_w_and_the_last_w():
    prompt = make_prompt(lengths=(40,))
    keep = Streaming(variant="factory", window=4).keep(prompt, Budget(tokens=12))
    assert kept_positions(keep) == set(range(8)) | set(range(36, 40))


def test_decode_never_evicts_the_sinks():
    policy, capacity = Streaming(), torch.full((1, 2), 7)
    positions = torch.arange(7).expand(1, 2, 7)
    for step in range(7, 30):
        positions = torch.cat([positions, torch.full((1, 2, 1), step)], dim=-1)
        valid = torch.ones_like(positions, dtype=torch.bool)
        _, keep = policy.decode_select({}, torch.randn(1, 4, 1, positions.shape[-1]), valid,
                                       positions, capacity)
        positions = positions[keep].view(1, 2, -1)
        assert positions[0, 0].tolist() == [0, 1, 2, 3, step - 2, step - 1, step]


def test_options_are_validated():
    with pytest.raises(PolicyError, match="streaming.variant"):
        Streaming(variant="rolling")
    with pytest.raises(PolicyError, match="streaming.sinks"):
        Streaming(sinks=-1)
