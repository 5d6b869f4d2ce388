"""The optimiser of a training run: AdamW with one learning rate for the gates and one for
LoRA, a linear warm-up, then a cosine down to a floor, stepped every optimiser step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvgate.training.errors import TrainingConfigError


@dataclass
class OptimSettings:
    """AdamW with one learning rate for the gates and one for LoRA, linear warm-up then cosine."""

    lr_gate: float = 1e-3  # gates start from scratch: a larger lr than the adapters
    lr_lora: float = 1e-4  # LoRA A/B matrices
    weight_decay: float = 0.0  # AdamW decoupled weight decay (both groups)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    warmup_ratio: float = 0.03  # fraction of all optimiser steps with a linear warm-up
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        checks = {
            "lr_gate": self.lr_gate > 0, "lr_lora": self.lr_lora > 0,
            "weight_decay": self.weight_decay >= 0,
            "betas": len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "warmup_ratio": 0 <= self.warmup_ratio < 1, "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise TrainingConfigError(
                    f"OptimSettings.{key}: out of range (got {getattr(self, key)!r})")
        for key in ("lr_gate", "lr_lora"):
            _check_first_step(key, getattr(self, key), self.betas[0], self.weight_decay)


# the trained tensors are fp32 whatever the base's dtype
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _check_first_step(key: str, lr: float, beta1: float, weight_decay: float) -> None:
    """AdamW's first step moves a weight by up to lr / (1 - beta1) and scales it by
    1 - lr * weight_decay; a rate whose step does not fit in fp32 used to fail inside torch
    (a 76-line overflow traceback) after the base had loaded."""
    largest = max(lr / (1.0 - beta1), lr * weight_decay)
    if not math.isfinite(lr) or largest > _FP32_MAX:
        raise TrainingConfigError(
            f"OptimSettings.{key}: {lr!r} is far too high: AdamW's first step "
            f"({largest:.3g}) overflows float32 (at most {_FP32_MAX:.3g}); learning rates "
            "are around 1e-3 (gates) and 1e-4 (LoRA)")


def lr_factor(step: int, total: int, warmup: int, floor: float) -> float:
    """Multiplier of the base lr at optimiser step ``step``: linear warm-up over ``warmup``
    steps, then a half cosine from 1 down to ``floor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_with_schedule(gate_params: list[nn.Parameter], lora_params: list[nn.Parameter],
                        settings: OptimSettings, total_steps: float) -> dict[str, Any]:
    """Lightning's optimiser config: AdamW over the non-empty groups (``gates``, ``lora``) and
    the warm-up + cosine schedule over ``total_steps`` (not finite: a schedule that never ends).
    """
    groups = []
    if gate_params:
        groups.append({"params": gate_params, "lr": settings.lr_gate, "name": "gates"})
    if lora_params:
        groups.append({"params": lora_params, "lr": settings.lr_lora, "name": "lora"})
    optimizer = torch.optim.AdamW(groups, betas=settings.betas,
                                  weight_decay=settings.weight_decay)
    total = int(total_steps) if math.isfinite(total_steps) else 10**9
    warmup = round(settings.warmup_ratio * total)
    floor = settings.min_lr_ratio
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, warmup, floor))
    return {"optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}
