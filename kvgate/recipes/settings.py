"""Typed recipe switches for training gates on small compute (validated on load)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.errors import KVGateError


class RecipeError(KVGateError, ValueError):
    """A recipe setting is out of range; the message names the key."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RecipeSettings:
    """Which small-compute aids the training loss uses. The defaults are the paper's plain
    objective (LM loss + eviction loss at a fixed beta), so an empty ``recipe:`` block
    reproduces the paper."""

    lm_weight: float = 1.0  # weight of the language-modelling loss
    distill_weight: float = 0.0  # weight of KL(gates-open teacher || gated student); 0 = off
    distill_temperature: float = 1.0  # softmax temperature of the KL
    # with LoRA, the teacher is the model with gates open and its adapters on ("adapted", a
    # target that moves as LoRA learns) or off ("base": the frozen full-cache base, so LoRA can
    # only learn to make up for what the gates evict); without LoRA the two are one model
    distill_teacher: str = "adapted"
    beta_start: float | None = None  # anneal beta from this value (1.0 = keep all); None = off
    beta_steps: int = 0  # optimiser steps over which beta goes from beta_start to gate.beta
    beta_schedule: str = "linear"  # linear | cosine
    warmstart_steps: int = 0  # first steps train gates on heuristic keep labels (BCE); 0 = off
    warmstart_policy: str = "h2o"  # heuristic whose masks are the labels (h2o | snapkv | ...)
    warmstart_keep: float | None = None  # keep ratio of the labels; None = gate.beta
    # gates against the base's KVzip labels (kvgate.recipes.oracle; data.init_args.oracle)
    oracle_weight: float = 0.0  # weight of the oracle loss; 0 = off
    oracle_loss: str = "mse_log"  # mse_log (KVzap) | bce (Fast KVzip) | rank (pairwise)
    oracle_keep: float | None = None  # KVzip's keep ratio for the labels; None = current beta

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> RecipeError:
            return RecipeError(f"RecipeSettings.{key}: {why} (got {getattr(self, key)!r})")

        if self.lm_weight < 0:
            raise bad("lm_weight", "must be >= 0")
        if self.distill_weight < 0:
            raise bad("distill_weight", "must be >= 0")
        if not _number(self.oracle_weight) or self.oracle_weight < 0:
            raise bad("oracle_weight", "must be a number >= 0")
        if self.lm_weight == 0 and self.distill_weight == 0 and self.oracle_weight == 0:
            raise bad("lm_weight", "lm_weight, distill_weight and oracle_weight cannot all be 0")
        if self.distill_temperature <= 0:
            raise bad("distill_temperature", "must be > 0")
        if self.distill_teacher not in ("adapted", "base"):
            raise bad("distill_teacher", "must be adapted or base")
        if self.beta_start is not None and not 0.0 <= self.beta_start <= 1.0:
            raise bad("beta_start", "must lie in [0, 1] or be null")
        if self.beta_steps < 0:
            raise bad("beta_steps", "must be >= 0")
        if self.beta_schedule not in ("linear", "cosine"):
            raise bad("beta_schedule", "must be linear or cosine")
        if self.warmstart_steps < 0:
            raise bad("warmstart_steps", "must be >= 0")
        if self.warmstart_keep is not None and not 0.0 < self.warmstart_keep <= 1.0:
            raise bad("warmstart_keep", "must lie in (0, 1] or be null")
        from kvgate.recipes.oracle import ORACLE_LOSSES

        if self.oracle_loss not in ORACLE_LOSSES:
            raise bad("oracle_loss", f"must be one of {' | '.join(ORACLE_LOSSES)}")
        if self.oracle_keep is not None and not (_number(self.oracle_keep)
                                                 and 0.0 < self.oracle_keep <= 1.0):
            raise bad("oracle_keep", "must lie in (0, 1] or be null")
        if self.warmstart_steps:
            from kvgate.policies import list_policies

            if self.warmstart_policy not in list_policies() or self.warmstart_policy == "attention_gate":
                raise bad("warmstart_policy", f"must be a heuristic policy: {list_policies()}")
