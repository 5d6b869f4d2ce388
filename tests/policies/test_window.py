import torch
from policy_testing import decode_inputs, kept_positions, make_prompt

from kvgate.policies import Budget, Window


def test_prefill_keeps_the_last_budget_tokens_of_each_sample():
    prompt = make_prompt(lengths=(20, 9))
    keep = Window().keep(prompt, Budget(tokens=6))
    assert kept_positions(keep, 0, 0) == set(range(14, 20))
    assert kept_positions(keep, 1, 1) == set(range(14, 20))  # last 6 of the 9 real tokens
    keep = Window().keep(prompt, Budget(tokens=15))
    assert kept_positions(keep, 1, 0) == set(range(11, 20))  # all 9 real, no padding


def test_decode_is_a_sliding_window():
    """After any step the store holds exactly the last min(B, seen) positions."""
    policy, capacity = Window(), torch.full((1, 1), 4)
    positions = torch.tensor([[[0, 1]]])
    for step in range(2, 12):
        positions = torch.cat([positions, torch.tensor([[[step]]])], dim=-1)
        valid = torch.ones_like(positions, dtype=torch.bool)
        logits = torch.randn(1, 2, 1, positions.shape[-1])
        _, keep = policy.decode_select({}, logits, valid, positions, capacity)
        positions = positions[keep].view(1, 1, -1)
        seen = step + 1
        assert positions.flatten().tolist() == list(range(max(0, seen - 4), seen))


def test_decode_ignores_invalid_slots():
    logits, valid, positions = decode_inputs()
    _, keep = Window().decode_select({}, logits, valid, positions, torch.full((2, 2), 3))
    for b in range(2):
        for h in range(2):
            held = positions[b, h][valid[b, h]]
            assert set(positions[b, h][keep[b, h]].tolist()) == set(held.sort().values[-3:]
                                                                     .tolist())
