"""Full cache: every real prompt entry stays; the reference every other policy is measured
against. No paper (this is no eviction at all): the budget is ignored on purpose."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import Budget, LayerPrompt, Policy, check_prompt, keep_all


@dataclass
class Full(Policy):
    """Keeps every real entry whatever the budget (the budget is ignored on purpose)."""

    name = "full"
    budget_free = True

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool: True exactly at the real (non-padding) positions."""
        check_prompt(prompt)
        return keep_all(prompt)
