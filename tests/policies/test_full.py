import torch
from policy_testing import make_prompt

from kvgate.policies import Budget, DecodeEvicting, Full, get_policy


def test_full_keeps_every_real_entry_whatever_the_budget():
    prompt = make_prompt(lengths=(20, 9))
    for budget in (Budget(tokens=3), Budget(ratio=0.1), Budget(ratio=1.0)):
        keep = Full().keep(prompt, budget)
        assert torch.equal(keep, prompt.valid[:, None, :].expand(2, 2, 20))


def test_full_is_registered_and_evicts_nothing_while_decoding():
    policy = get_policy("full")
    assert isinstance(policy, Full) and not isinstance(policy, DecodeEvicting)
    assert not policy.encode_mask
