from itertools import pairwise

import pytest
import torch
from policy_testing import make_prompt

from kvgate.policies import Budget, PolicyError, PyramidKV, SnapKV
from kvgate.policies.pyramidkv import pyramid_selected


def selected(layers, base, available, integer_step=False):
    b, a = torch.tensor([base]), torch.tensor([available])
    return [int(pyramid_selected(b, a, layer, layers, 20.0, integer_step)) for layer in
            range(layers)]


def test_spec_integer_step_example_overshoots():
    sel = selected(32, 96, 100_000, integer_step=True)
    assert sel[0] == 188 and sel[31] == 33
    assert sum(sel) / 32 == 110.5  # about 15% over the base budget


def test_spec_float_example():
    sel = selected(32, 96, 100_000)
    assert sel[0] == 187 and sel[-1] == 5


@pytest.mark.parametrize("layers,base,available",
                         [(32, 96, 10_000), (7, 13, 40), (5, 30, 33), (16, 0, 50), (2, 9, 9)])
def test_float_invariants(layers, base, available):
    sel = selected(layers, base, available)
    assert abs(sum(sel) - layers * base) <= layers / 2
    assert all(a >= b for a, b in pairwise(sel))
    assert sel[0] <= available


def test_policy_budget_per_layer_and_snapkv_ranking():
    counts = []
    for layer in range(4):
        prompt = make_prompt(lengths=(64,), layer_idx=layer, num_layers=4)
        keep = PyramidKV(window=4).keep(prompt, Budget(tokens=20))
        counts.append(int(keep[0, 0].sum()))
        assert keep[0, :, -4:].all()
        same = SnapKV(window=4).keep(prompt, Budget(tokens=counts[-1]))
        assert torch.equal(keep, same)
    assert counts == sorted(counts, reverse=True) and counts[0] > 20 > counts[-1]
    assert abs(sum(counts) - 4 * 20) <= 2


def test_single_layer_models_get_the_uniform_budget():
    prompt = make_prompt(lengths=(40,), layer_idx=0, num_layers=1)
    assert (PyramidKV(window=4).keep(prompt, Budget(tokens=10)).sum(-1) == 10).all()


def test_options_are_validated():
    with pytest.raises(PolicyError, match="pyramidkv.beta"):
        PyramidKV(beta=0.5)
    with pytest.raises(PolicyError, match="pyramidkv.integer_step"):
        PyramidKV(integer_step="yes")
