import math

import torch
from policy_testing import kept_positions, make_prompt, prompt_from_attention

from kvgate.policies import TOVA, Budget
from kvgate.policies.tova import shared_by_position


def test_last_row_is_averaged_over_all_heads_of_the_layer():
    # head 0 alone would keep {0, 2}, head 1 alone {1, 2}; the layer mean [.35, .2, .45] wins
    attn = [[[1, 0, 0], [.5, .5, 0], [.6, .1, .3]], [[1, 0, 0], [.5, .5, 0], [.1, .3, .6]]]
    keep = TOVA().keep(prompt_from_attention(attn), Budget(tokens=2))
    assert kept_positions(keep, 0, 0) == kept_positions(keep, 0, 1) == {0, 2}


def test_every_head_of_a_layer_keeps_the_same_tokens():
    keep = TOVA().keep(make_prompt(lengths=(24, 15), heads=6, kv_heads=3), Budget(tokens=7))
    assert (keep == keep[:, :1]).all() and (keep.sum(-1) == 7).all()


def test_decode_aligns_heads_by_position_not_by_slot():
    # two KV heads store positions {0, 5, 9, 12} in different slot orders
    positions = torch.tensor([[[0, 5, 9, 12], [9, 12, 0, 5]]])
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    probs = {0: [.1, .3], 5: [.4, .1], 9: [.2, .2], 12: [.3, .4]}  # per KV head (= query head)
    logits = torch.empty(1, 2, 1, 4)
    for h in range(2):
        for slot in range(4):
            logits[0, h, 0, slot] = math.log(probs[int(positions[0, h, slot])][h])
    _, keep = TOVA().decode_select({}, logits, valid, positions, torch.full((1, 2), 2))
    # means: 0 -> .2, 5 -> .25, 9 -> .2, 12 -> .35  => keep {5, 12} in both heads
    for h in range(2):
        assert set(positions[0, h][keep[0, h]].tolist()) == {5, 12}


def test_shared_by_position_averages_only_over_heads_that_hold_the_token():
    per_head = torch.tensor([[[.6, .2], [.3, .0]]])
    valid = torch.tensor([[[True, True], [True, False]]])
    positions = torch.tensor([[[4, 7], [4, -1]]])
    mean = shared_by_position(per_head, valid, positions, group=1)
    assert torch.allclose(mean[0, 0], torch.tensor([.45, .2]))
