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
    for bad in ({"window": 0}, {"window": 1.5}, {"window": 0.0}, {"kernel": 2},
                {"pooling": "median"}, {"gqa": "sum"}):
        with pytest.raises(PolicyError, match="snapkv." + next(iter(bad))):
            SnapKV(**bad)


def test_share_window_scales_with_each_prompt():
    """window=0.25: a 20-token prompt votes with its last 5 rows, a 9-token one with its last 2
    (left-padded in one batch), and each keeps exactly that window plus the top scores."""
    prompt = make_prompt(lengths=(20, 9))
    policy = SnapKV(window=0.25, kernel=1)
    assert policy.window_tokens(prompt.n_real).tolist() == [5, 2]
    keep = policy.keep(prompt, Budget(tokens=8))
    assert set(range(15, 20)) <= kept_positions(keep, 0, 0)
    assert {18, 19} <= kept_positions(keep, 1, 0)
    assert keep.sum(-1).tolist() == [[8, 8], [8, 8]]


def test_share_window_matches_the_same_window_in_tokens():
    prompt = make_prompt(lengths=(24,))
    share, tokens = SnapKV(window=0.25), SnapKV(window=6)
    assert torch.equal(share.scores(prompt), tokens.scores(prompt))
    assert torch.equal(share.keep(prompt, Budget(ratio=0.5)), tokens.keep(prompt, Budget(ratio=0.5)))


def test_share_window_leaves_room_for_voted_entries_on_short_prompts():
    """The failure the share fixes: at 50% of a 40-token prompt a 32-token window is the whole
    budget (a local window); a 10% window keeps 4 recent tokens and votes for the other 16."""
    prompt = make_prompt(lengths=(40,))
    fixed = SnapKV().keep(prompt, Budget(ratio=0.5))
    assert kept_positions(fixed, 0, 0) == set(range(20, 40))
    share = SnapKV(window=0.1).keep(prompt, Budget(ratio=0.5))
    assert kept_positions(share, 0, 0) != set(range(20, 40))
    assert set(range(36, 40)) <= kept_positions(share, 0, 0)
