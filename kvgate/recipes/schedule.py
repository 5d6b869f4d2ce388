"""Retention target schedule: beta annealed from a start value to its final value."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RetentionSchedule:
    """beta(step): ``start`` at step 0 -> ``end`` at ``steps``, then held.

    Asking the gates for the final eviction at once makes them collapse per layer/head
    (all-or-nothing); annealing lets the LM/distillation loss shape which tokens go first.
    """

    start: float = 1.0
    end: float = 0.4
    steps: int = 0  # 0 = no annealing: beta = end from the first step
    kind: str = "linear"  # linear | cosine

    def __post_init__(self) -> None:
        if not (0.0 <= self.end <= 1.0 and 0.0 <= self.start <= 1.0):
            raise ValueError(f"RetentionSchedule: start/end must lie in [0, 1], got {self.start}, {self.end}")
        if self.steps < 0:
            raise ValueError(f"RetentionSchedule.steps must be >= 0, got {self.steps}")
        if self.kind not in ("linear", "cosine"):
            raise ValueError(f"RetentionSchedule.kind must be linear or cosine, got {self.kind!r}")

    def __call__(self, step: int) -> float:
        if self.steps == 0 or step >= self.steps:
            return self.end
        frac = max(step, 0) / self.steps
        if self.kind == "cosine":
            frac = 0.5 * (1.0 - math.cos(math.pi * frac))
        return self.start + (self.end - self.start) * frac
