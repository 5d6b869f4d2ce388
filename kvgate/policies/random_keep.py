"""Random: keep a uniform random subset of ``B`` prompt entries per (layer, KV head).

No paper: a control. The floor every scoring rule has to beat: it spends the same budget with no information. The
draw is seeded per (seed, layer) and indexed by each token's index among the real tokens, so a
left-padded batch keeps exactly what each prompt would keep alone and reruns are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    ScoredPolicy,
    check_int,
    seeded_uniform,
)


@dataclass
class RandomKeep(ScoredPolicy):
    """Uniformly random kept entries (random scores, top ``B``); ``seed`` picks the draw."""

    seed: int = 0

    name = "random"
    needs_attention = False

    def __post_init__(self) -> None:
        check_int(self.name, "seed", self.seed, 0)

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """Uniform scores ``[B, H_kv, n]`` indexed by (head, index among real tokens)."""
        return seeded_uniform(prompt, self.seed)
