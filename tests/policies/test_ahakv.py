import math
from dataclasses import replace

import pytest
import torch
from policy_testing import make_prompt

from kvgate.policies import AhaKV, Budget, PolicyError, SnapKV
from kvgate.policies.ahakv import sg_lambda, value_weights


def test_spec_lambda_values():
    assert abs(float(sg_lambda(4000, 1000)) - 1.6651) < 1e-4
    assert abs(float(sg_lambda(16000, 1000)) - 2.3548) < 1e-4
    assert float(sg_lambda(900, 1000)) == 0.0 and float(sg_lambda(1000, 1000)) == 0.0


def test_spec_avgpool_edge_example_both_padding_modes():
    nu = torch.tensor([1.0, 4, 1, 1, 9]).sqrt().view(1, 1, 5, 1)
    valid = torch.ones(1, 5, dtype=torch.bool)
    include = value_weights(nu, valid, 3, count_include_pad=True)
    exclude = value_weights(nu, valid, 3, count_include_pad=False)
    assert torch.allclose(include.flatten(), torch.tensor([.455, .545, .545, 1, .909]), atol=1e-3)
    assert torch.allclose(exclude.flatten(), torch.tensor([.5, .4, .4, .733, 1]), atol=1e-3)


def test_value_prior_ignores_left_padding_in_both_modes():
    prompt = make_prompt(lengths=(12, 7))
    for include in (True, False):
        batched = value_weights(prompt.value, prompt.valid, 3, include)
        alone = value_weights(prompt.value[1:, :, 5:], prompt.valid[1:, 5:], 3, include)
        assert torch.allclose(batched[1, :, 5:], alone[0]) and (batched[1, :, :5] == 0).all()


def test_no_prior_and_unit_lambda_equals_snapkv_w32_no_pooling_sum():
    prompt = make_prompt(lengths=(60, 45))
    aha = AhaKV(value_prior=False, lambda_mode="none")
    snap = SnapKV(window=32, kernel=1, aggregate="sum")
    for budget in (Budget(tokens=40), Budget(ratio=0.7)):
        assert torch.equal(aha.keep(prompt, budget), snap.keep(prompt, budget))


def test_recent_tokens_are_kept_and_the_prior_changes_the_choice():
    prompt = make_prompt(lengths=(48,))
    keep = AhaKV(recent=8).keep(prompt, Budget(tokens=16))
    assert keep[0, :, -8:].all() and (keep.sum(-1) == 16).all()
    plain = AhaKV(recent=8, value_prior=False).keep(prompt, Budget(tokens=16))
    assert not torch.equal(keep, plain)


def test_lambda_multiplies_the_scaled_logits():
    prompt = make_prompt(lengths=(64,))
    lam = float(sg_lambda(64, 8))
    sharp = AhaKV(recent=4).scores(prompt, Budget(tokens=8))
    by_hand = replace(prompt, query=prompt.query * lam)
    plain = AhaKV(recent=4, lambda_mode="none").scores(by_hand, Budget(tokens=8))
    assert lam > 1.0 and torch.allclose(sharp, plain, atol=1e-5)


def test_decode_adds_sg_softmax_rows_with_the_prefill_lambda():
    policy = AhaKV(recent=1)
    prompt = make_prompt(lengths=(40,))
    keep = policy.keep(prompt, Budget(tokens=10))
    stats = policy.decode_init(prompt, keep)
    lam = float(sg_lambda(40, 10))
    assert torch.allclose(stats["lam"], torch.full((1, 2, 40), lam))
    score = torch.cat([stats["score"][keep].view(1, 2, 10), torch.zeros(1, 2, 1)], -1)
    lam_slots = torch.cat([stats["lam"][keep].view(1, 2, 10), torch.zeros(1, 2, 1)], -1)
    positions = torch.cat([torch.nonzero(keep[0, 0]).view(1, 1, 10).expand(1, 2, 10),
                           torch.full((1, 2, 1), 40)], -1)
    logits = torch.randn(1, 4, 1, 11)
    valid = torch.ones(1, 2, 11, dtype=torch.bool)
    new, kept = policy.decode_select({"score": score, "lam": lam_slots}, logits, valid,
                                     positions, torch.full((1, 2), 10))
    added = torch.softmax(logits[0, :, 0] * lam, -1).view(2, 2, 11).mean(1)
    assert torch.allclose(new["score"][0], score[0] + added, atol=1e-6)
    assert kept[..., -1].all() and (kept.sum(-1) == 10).all()
    assert torch.allclose(new["lam"], torch.full((1, 2, 11), lam))


def test_scores_need_the_budget_and_options_are_validated():
    with pytest.raises(PolicyError, match="needs the budget"):
        AhaKV().scores(make_prompt())
    with pytest.raises(PolicyError, match="ahakv.lambda_mode"):
        AhaKV(lambda_mode="decode")
    with pytest.raises(PolicyError, match="ahakv.kernel"):
        AhaKV(kernel=4)
    assert math.isclose(float(sg_lambda(4000, 1000)) / math.sqrt(128), 0.1472, abs_tol=1e-4)
