import pytest
import torch
from policy_testing import make_prompt

from kvgate.policies import H2O, AdaKV, Budget, PolicyError, SnapKV
from kvgate.policies.adakv import allocate_heads

SPEC_S = torch.tensor([[[.9, .05, .03, .02, .0, .0], [.3, .3, .2, .2, .0, .0]]])
ALL = torch.ones(1, 2, 6, dtype=torch.bool)
BASE = torch.tensor([[3, 3]])


def test_spec_hand_check_official_rounding():
    c, alloc = allocate_heads(SPEC_S, ALL, BASE, alpha=0.5)
    assert c.tolist() == [[2, 4]] and alloc.tolist() == [[2, 3]]  # one token lost to the floor


def test_spec_hand_check_exact_variant():
    _, alloc = allocate_heads(SPEC_S, ALL, BASE, alpha=0.5, exact=True)
    assert alloc.tolist() == [[2, 4]]


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("seed", range(3))
def test_invariants_i_to_iii(alpha, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 4, 30, generator=gen) ** 4
    cand = torch.rand(3, 4, 30, generator=gen) > 0.1
    base = torch.tensor([[5] * 4, [9] * 4, [1] * 4])
    c, official = allocate_heads(scores, cand, base, alpha)
    _, exact = allocate_heads(scores, cand, base, alpha, exact=True)
    assert torch.equal(c.sum(-1), base.sum(-1))                           # (i)
    floor = torch.floor(alpha * base.double() + 1e-9).long()
    assert (official >= floor).all() and (exact >= floor).all()            # (ii)
    assert torch.equal(exact.sum(-1), base.sum(-1))                        # (iii)


def test_invariant_iv_identical_heads_get_the_uniform_budget():
    scores = torch.rand(1, 1, 20).expand(2, 3, 20)
    c, alloc = allocate_heads(scores, torch.ones(2, 3, 20, dtype=torch.bool),
                              torch.full((2, 3), 6), alpha=0.2)
    assert (c == 6).all() and (alloc == 6).all()


def test_invariant_v_alpha_one_is_uniform_snapkv():
    prompt = make_prompt(lengths=(32, 21))
    ada = AdaKV(inner_options={"window": 4}, alpha=1.0)
    assert torch.equal(ada.keep(prompt, Budget(tokens=10)),
                       SnapKV(window=4).keep(prompt, Budget(tokens=10)))


def test_heads_get_different_budgets_and_the_window_stays():
    prompt = make_prompt(lengths=(48,), heads=8, kv_heads=4)
    keep = AdaKV(inner_options={"window": 4}, exact=True).keep(prompt, Budget(tokens=12))
    counts = keep.sum(-1)
    assert counts.sum() == 4 * 12 and len(set(counts.flatten().tolist())) > 1
    assert keep[0, :, -4:].all()
    floor = int(0.2 * 8)
    assert (counts >= 4 + floor).all()


def test_skip_layers_use_uniform_budgets():
    prompt = make_prompt(lengths=(48,), heads=8, kv_heads=4, layer_idx=1)
    keep = AdaKV(inner_options={"window": 4}, skip=2).keep(prompt, Budget(tokens=12))
    assert (keep.sum(-1) == 12).all()


def test_ada_h2o_and_ada_pyramid_and_instances():
    prompt = make_prompt(lengths=(40,), heads=8, kv_heads=4)
    for inner in ("h2o", "pyramidkv", H2O(recent=4), SnapKV(window=4)):
        keep = AdaKV(inner=inner, exact=True).keep(prompt, Budget(tokens=12))
        assert keep.shape == (1, 4, 40)
    normalized = AdaKV(inner_options={"window": 4}, normalize=True, exact=True)
    assert normalized.keep(prompt, Budget(tokens=12)).sum() == 4 * 12


def test_options_are_validated():
    with pytest.raises(PolicyError, match="adakv.inner"):
        AdaKV(inner="ahakv")
    with pytest.raises(PolicyError, match="adakv.inner_options"):
        AdaKV(inner_options={"windw": 3})
    with pytest.raises(PolicyError, match="adakv.alpha"):
        AdaKV(alpha=1.5)
    with pytest.raises(PolicyError, match="adakv.skip"):
        AdaKV(skip=-1)
