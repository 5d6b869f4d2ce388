"""Distillation from the full-cache teacher: the same weights with every gate open."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvgate.gate.patch import gates_open


@torch.no_grad()
def teacher_logits(model: nn.Module, adapters: bool = True, **batch) -> Tensor:
    """Logits of the model with all gates open, no grad: the base model plus any LoRA, or with
    ``adapters=False`` the frozen base alone (a fixed target the LoRA cannot move)."""
    disable = getattr(model, "disable_adapter", None)  # peft's context manager
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # a target without dropout noise (LoRA's dropout acts in training mode)
    try:
        with gates_open(model), (nullcontext() if adapters or disable is None else disable()):
            return model(**batch).logits.detach()
    finally:
        for m, training in modes:
            m.training = training


def distillation_loss(student: Tensor, teacher: Tensor, mask: Tensor | None = None,
                      temperature: float = 1.0) -> Tensor:
    """Token-mean KL(teacher || student) over positions where ``mask`` [B, n] is True.

    student, teacher [B, n, V] logits. Zero exactly when the two distributions agree (gates all
    open), so mixing it with the LM loss never pulls an un-evicting model anywhere.
    """
    if student.shape != teacher.shape:
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} logits differ")
    t = temperature
    log_p = F.log_softmax(teacher.float() / t, dim=-1)
    log_q = F.log_softmax(student.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1) * (t * t)  # [B, n]
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)
