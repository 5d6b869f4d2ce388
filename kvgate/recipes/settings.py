"""Typed recipe switches for training gates on small compute (validated on load)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvgate.errors import KVGateError

# removed settings, each with why and what replaced it. A checkpoint's hyper-parameters or a
# saved config may still carry them: from_dict drops them (a finished run's record), and
# kvgate.cli.retired drops them from a config that asks for nothing they did (the warm start
# off: warmstart_steps 0) and refuses, in one line naming this, one that asks for it
WARM_START = ("the warm start (gates first trained on a heuristic's keep labels) was removed: "
              "it did not help (experiments/LOG.md); remove the key (experiments/README.md "
              "says how the cpt_recipe rows trained with it are reproduced)")
RETIRED: dict[str, str] = {"warmstart_steps": WARM_START, "warmstart_policy": WARM_START,
                           "warmstart_keep": WARM_START}


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
        from kvgate.recipes.oracle import ORACLE_LOSSES

        if self.oracle_loss not in ORACLE_LOSSES:
            raise bad("oracle_loss", f"must be one of {' | '.join(ORACLE_LOSSES)}")
        if self.oracle_keep is not None and not (_number(self.oracle_keep)
                                                 and 0.0 < self.oracle_keep <= 1.0):
            raise bad("oracle_keep", "must lie in (0, 1] or be null")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecipeSettings:
        """The settings of a plain dict (a checkpoint's hyper-parameters). A removed setting's
        key (``RETIRED``) is dropped: a run trained with it is over, and its checkpoint still
        loads; any other unknown key is a ``RecipeError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(RETIRED))
        if unknown:
            raise RecipeError(f"RecipeSettings: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**{key: value for key, value in data.items() if key in known})
