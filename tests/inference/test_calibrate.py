"""Threshold calibration: the search reaches each target share (or says it cannot), shares its
measurements across targets, and on a tiny gated LLaMA the fitted threshold evicts the share
it reports when the context is compressed again."""

from __future__ import annotations

import pytest
from conftest import build, patch_evicting, tiny_llama_config
from engine_toys import char_tokenizer

from kvgate.inference.calibrate import calibrate, evicted_share, fit_taus, with_tau
from kvgate.policies import PolicyError, get_policy


def test_each_target_is_reached_within_tolerance_and_runs_are_shared():
    calls = []

    def share(tau):
        return 0.1 + 0.8 * tau ** 2  # smooth, monotone, 10-90%

    fits = fit_taus(lambda tau: calls.append(tau) or share(tau), [0.75, 0.25, 0.5], tol=0.005)
    assert [f.target for f in fits] == [0.75, 0.25, 0.5]  # the order asked
    for f in fits:
        assert f.reached and abs(share(f.tau) - f.target) <= 0.005
        assert f.evicted == pytest.approx(share(f.tau))
    assert len(calls) == len(set(calls)) == sum(f.runs for f in fits)  # never measured twice
    assert len(calls) <= 15


def test_a_share_the_gate_cannot_reach_ends_at_the_closest_measured():
    fits = fit_taus(lambda tau: min(0.6, tau), [0.9, 0.3], tol=0.01, max_runs=6)
    high, low = fits
    assert not high.reached and high.evicted == pytest.approx(0.6) and high.runs == 6
    assert low.reached


def test_a_step_share_stops_when_its_bracket_is_exhausted():
    fits = fit_taus(lambda tau: 0.2 if tau < 0.4 else 0.7, [0.5], max_runs=200)
    assert fits[0].runs < 200 and fits[0].evicted in (0.2, 0.7)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, True, "half"])
def test_targets_outside_the_open_interval_are_refused(bad):
    with pytest.raises(PolicyError, match="target evicted share"):
        fit_taus(lambda tau: tau, [bad])


def test_only_a_policy_with_a_threshold_can_be_calibrated():
    with pytest.raises(PolicyError, match="no threshold"):
        with_tau(get_policy("snapkv"), 0.5)
    assert with_tau(get_policy("local_gate", window=4), 0.3).tau == 0.3
    with pytest.raises(PolicyError, match="tau"):
        with_tau(get_policy("local_gate"), 1.5)


@pytest.fixture(scope="module")
def gated():
    model = build(tiny_llama_config(max_position_embeddings=640))
    patch_evicting(model)
    return model


def test_the_fitted_threshold_evicts_the_share_it_reports(gated):
    tok = char_tokenizer()
    contexts = ["the cat sat on the mat and looked at the door " * 4,
                "a quick brown fox jumps over the lazy dog, twice over " * 4]
    policy = get_policy("local_gate", window=4)
    fits = calibrate(gated, tok, policy, contexts, [0.3, 0.6], tol=0.03, max_runs=12)
    for f in fits:
        again = evicted_share(gated, tok, with_tau(policy, f.tau), contexts)
        assert again == pytest.approx(f.evicted)
        assert f.reached, f
    assert fits[0].tau < fits[1].tau  # a higher threshold evicts more
