import math

import pytest
import torch
from policy_testing import make_prompt

from kvgate.policies import Budget, PolicyError, RoCo, StreamingPrefill
from kvgate.policies.roco import mas_std, roco_keep


def stats_of(*rows):
    a = torch.tensor(rows, dtype=torch.float32)  # [tokens, rows]
    return a.sum(-1).view(1, 1, -1), a.square().sum(-1).view(1, 1, -1), \
        torch.full((1, 1, a.shape[0]), float(a.shape[1]))


def evict(mas, std, scope):
    valid = torch.ones_like(mas, dtype=torch.bool)
    keep = roco_keep(mas, std, valid, torch.zeros_like(valid), torch.tensor([[scope]]),
                     torch.tensor([[mas.shape[-1] - 1]]))
    return torch.nonzero(~keep[0, 0]).flatten().tolist()


def test_spec_hand_check_mas_and_std():
    mas, std = mas_std(*stats_of([.5, .1, .3], [.2, .2, .2]))
    assert torch.allclose(mas, torch.tensor([[[.3, .2]]]))
    assert abs(float(std[0, 0, 0]) - 0.1633) < 1e-4 and float(std[0, 0, 1]) < 1e-3
    assert evict(mas, std, scope=1) == [1]  # B evicted (H2O would agree: .9 vs .6)


def test_spec_swap_applies_the_scope_before_the_argmin():
    mas, std = mas_std(*stats_of([.5, .1, .3], [.4, .4, .4]))
    assert evict(mas, std, scope=1) == [1]  # B is the only scope member (H2O would evict A)
    assert evict(mas, std, scope=2) == [0]  # both in scope: lowest MAS (A, .3 < .4)


def test_decode_select_hand_check_through_the_policy():
    acc, acc2, cnt = stats_of([.5, .1, .3], [.4, .4, .4])
    policy = RoCo(sinks=0, protect_last=0)
    hidden = torch.full((1, 1, 1, 2), -math.inf)  # a row that sees nothing adds nothing
    stats, keep = policy.decode_select({"acc": acc, "acc2": acc2, "cnt": cnt}, hidden,
                                       torch.ones(1, 1, 2, dtype=torch.bool),
                                       torch.tensor([[[0, 1]]]), torch.tensor([[1]]))
    assert keep.flatten().tolist() == [True, False] and torch.equal(stats["cnt"], cnt)


def test_decode_never_evicts_sinks_or_the_last_ten_and_holds_the_budget():
    policy = RoCo()
    gen = torch.Generator().manual_seed(0)
    capacity = torch.full((1, 2), 20)
    positions = torch.arange(20).expand(1, 2, 20)
    stats = {name: torch.zeros(1, 2, 20) for name in ("acc", "acc2", "cnt")}
    for step in range(20, 60):
        positions = torch.cat([positions, torch.full((1, 2, 1), step)], dim=-1)
        stats = {k: torch.cat([v, torch.zeros(1, 2, 1)], dim=-1) for k, v in stats.items()}
        valid = torch.ones_like(positions, dtype=torch.bool)
        logits = torch.randn(1, 4, 1, positions.shape[-1], generator=gen) * 3
        stats, keep = policy.decode_select(stats, logits, valid, positions, capacity)
        assert (keep.sum(-1) == 20).all()
        for h in range(2):
            held = set(positions[0, h][keep[0, h]].tolist())
            assert {0, 1, 2, 3} | set(range(step - 9, step + 1)) <= held
        positions = positions[keep].view(1, 2, -1)
        stats = {k: v[keep].view(1, 2, -1) for k, v in stats.items()}


def test_streamed_prefill_counts_rows_that_saw_each_entry():
    policy = RoCo(sinks=2, protect_last=3, block=4)
    prompt = make_prompt(lengths=(30, 19))
    keep = policy.keep(prompt, Budget(tokens=10))
    stats = policy.decode_init(prompt, keep)
    assert (keep.sum(-1) == 10).all()
    n_real = prompt.n_real.tolist()
    for b in range(2):
        start = 30 - n_real[b]
        # sinks are never evicted, so every later real row saw them
        assert keep[b, :, start:start + 2].all()
        assert stats["cnt"][b, :, start].tolist() == [float(n_real[b])] * 2
        assert keep[b, :, -3:].all()
    for name in ("acc", "acc2", "cnt"):
        assert (stats[name][1, :, :11] == 0).all()  # padding never accumulates


def test_one_shot_differs_from_scoring_with_the_full_matrix():
    """Rows after an eviction renormalise over the survivors (evict-while-encoding)."""
    policy = RoCo(sinks=1, protect_last=2, block=2)
    prompt = make_prompt(lengths=(24,))
    stats = policy.simulate(prompt, torch.tensor([8]))[0]
    all_rows = policy.simulate(prompt, torch.tensor([24]))[0]
    assert not torch.allclose(stats["acc"], all_rows["acc"])


def test_options_are_validated():
    with pytest.raises(PolicyError, match="roco.block"):
        RoCo(block=0)
    with pytest.raises(PolicyError, match="roco.recent_ratio"):
        RoCo(recent_ratio=1.0)
    assert issubclass(RoCo, StreamingPrefill)  # and so DecodeEvicting


def test_stats_without_eviction_take_one_pass_and_equal_the_streamed_ones():
    """The streamed prefill's head (nothing evicted yet) is summed in one pass: the same
    acc / acc2 / cnt as streaming it block by block, padding included."""
    policy = RoCo(block=4)
    prompt = make_prompt(heads=4, kv_heads=2, lengths=(30, 19))
    streamed = policy.simulate(prompt, prompt.n_real)[0]
    keep = prompt.valid[:, None, :].expand(2, 2, 30)
    one_pass = policy.decode_init(prompt, keep)
    for name in ("acc", "acc2", "cnt"):
        assert torch.allclose(one_pass[name], streamed[name], atol=1e-5), name
    assert streamed["acc2"].max() > 0.05 and not torch.allclose(
        streamed["acc2"], policy.simulate(prompt, torch.tensor([8, 8]))[0]["acc2"])
