import pytest
import torch
from policy_testing import kept_positions, make_prompt, prompt_from_attention

from kvgate.policies import Budget, PolicyError, SnapKV
from kvgate.policies.base import pool1d


def test_spec_maxpool_example():
    out = pool1d(torch.tensor([[0.0, 1, 0, 0, 0]]), 3, "max")
    assert out.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]


def test_avgpool_zero_pads_and_divides_by_the_kernel_at_edges():
    out = pool1d(torch.tensor([[3.0, 0, 0, 0, 6]]), 3, "avg")
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, 0.0, 2.0, 2.0]]))


def test_spec_hand_check_k1_w2_n6_b4():
    # window rows 4 and 5 give window-mean scores [.4, .1, .3, .05] on keys 0..3
    rows = [[1, 0, 0, 0, 0, 0], [.5, .5, 0, 0, 0, 0], [.3, .3, .4, 0, 0, 0],
            [.25, .25, .25, .25, 0, 0], [.4, .1, .3, .05, .15, 0], [.4, .1, .3, .05, .1, .05]]
    prompt = prompt_from_attention([rows])
    policy = SnapKV(window=2, kernel=1)
    assert torch.allclose(policy.scores(prompt)[0, 0, :4], torch.tensor([.4, .1, .3, .05]),
                          atol=1e-6)
    assert kept_positions(policy.keep(prompt, Budget(tokens=4))) == {0, 2, 4, 5}


def test_window_is_always_kept_and_the_rest_is_top_pooled_score():
    prompt, policy = make_prompt(lengths=(24,)), SnapKV(window=5, kernel=3, pooling="avg")
    keep = policy.keep(prompt, Budget(tokens=10))
    scores = policy.scores(prompt)[0]
    for h in range(2):
        assert keep[0, h, -5:].all()
        chosen = keep[0, h, :19]
        assert chosen.sum() == 5 and scores[h, :19][chosen].min() > scores[h, :19][~chosen].max()


def test_window_votes_do_not_leak_into_prefix_pooling():
    rows = [[1, 0, 0, 0], [.5, .5, 0, 0], [.1, .1, .8, 0], [.1, .1, .7, .1]]
    scores = SnapKV(window=2, kernel=3, aggregate="sum").scores(prompt_from_attention([rows]))
    # key 1's neighbourhood is {0, 1, 2}; key 2 is in the window and must not count
    assert torch.allclose(scores[0, 0, :2], torch.tensor([0.2, 0.2]), atol=1e-6)


def test_sum_and_mean_aggregation_rank_alike():
    prompt = make_prompt(lengths=(24, 13))
    a = SnapKV(window=4, aggregate="sum").keep(prompt, Budget(tokens=9))
    b = SnapKV(window=4, aggregate="mean").keep(prompt, Budget(tokens=9))
    assert torch.equal(a, b)


def test_a_budget_below_the_window_keeps_the_newest_tokens():
    keep = SnapKV(window=8).keep(make_prompt(lengths=(24,)), Budget(tokens=3))
    assert kept_positions(keep, 0, 1) == {21, 22, 23}


def test_options_are_validated():
    for bad in ({"window": 0}, {"kernel": 2}, {"pooling": "median"}, {"gqa": "sum"}):
        with pytest.raises(PolicyError, match="snapkv." + next(iter(bad))):
            SnapKV(**bad)
