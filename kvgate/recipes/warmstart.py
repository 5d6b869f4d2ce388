"""Warm start: supervised pre-training of the gates on a heuristic's keep decisions.

Labels come from a heuristic policy (H2O or SnapKV masks at the target keep ratio) run on the
model's own post-RoPE q/k with every gate open. The gate's logit ``s + gamma - logit(tau)`` is
trained with class-balanced BCE, so its decision boundary (sigmoid(s + gamma) > tau) is what
learns the labels, whatever the class ratio.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvgate.attention.masks import new_token_validity
from kvgate.gate.apply import gate_attention_mask
from kvgate.gate.patch import gates_open
from kvgate.models import dispatch
from kvgate.policies.base import Budget, LayerPrompt, Policy


@torch.no_grad()
def heuristic_labels(model: nn.Module, policy: Policy, budget: Budget, input_ids: Tensor,
                     attention_mask: Tensor | None = None) -> dict[int, Tensor]:
    """Keep masks ``{layer_idx: [B, H_kv, n] bool}`` the heuristic picks for this batch."""
    labels: dict[int, Tensor] = {}
    num_layers = len(dispatch.attention_modules(model))

    def tap(module, query, key, value, mask, scaling, call):
        b, _, n, _ = query.shape
        prompt = LayerPrompt(module.layer_idx, num_layers, query, key, value,
                             new_token_validity(mask, b, n, query.device),
                             scaling or 1.0 / math.sqrt(query.shape[-1]), call.hidden, module)
        labels[module.layer_idx] = policy.keep(prompt, budget)

    with gates_open(model), dispatch.tapped(model, tap):
        model(input_ids=input_ids, attention_mask=attention_mask)
    return labels


def warmstart_loss(model: nn.Module, labels: dict[int, Tensor], input_ids: Tensor,
                   attention_mask: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Class-balanced BCE between each gate's keep logit and the heuristic labels.

    Runs the base with gates open (the gates read the layer inputs a gates-open model
    produces, which is what the labels were computed on). Returns (loss, {"accuracy", "balanced_accuracy"}).
    """
    hidden: dict[int, tuple] = {}

    def tap(module, query, key, value, mask, scaling, call):
        b, _, n, _ = query.shape
        hidden[module.layer_idx] = (call.hidden, call.position_embeddings,
                                    new_token_validity(mask, b, n, query.device))

    with torch.no_grad(), gates_open(model), dispatch.tapped(model, tap):
        model(input_ids=input_ids, attention_mask=attention_mask)
    losses, correct, total, tpr, tnr = [], 0.0, 0.0, [], []
    for module in dispatch.attention_modules(model):
        if module.layer_idx not in labels or not hasattr(module, "kv_gate"):
            continue
        gate = module.kv_gate
        cfg = gate.config
        if module.layer_idx < cfg.ungated_layers:
            continue
        h, pos, valid = hidden[module.layer_idx]
        attend = gate_attention_mask(gate, valid, valid)
        logit = gate.scores(h, pos, attend) + cfg.gamma - math.log(cfg.tau / (1 - cfg.tau))
        y = labels[module.layer_idx].to(logit.dtype)
        if y.shape != logit.shape:  # per-query-head gates learn their KV head's label
            y = y.repeat_interleave(logit.shape[1] // y.shape[1], 1)
        w = valid[:, None, :].expand_as(y).to(logit.dtype)
        pos_frac = (y * w).sum() / w.sum().clamp(min=1)
        pos_frac = pos_frac.clamp(1e-3, 1 - 1e-3)
        weight = w * torch.where(y > 0.5, 0.5 / pos_frac, 0.5 / (1 - pos_frac))
        losses.append(F.binary_cross_entropy_with_logits(logit, y, weight=weight, reduction="sum")
                      / w.sum().clamp(min=1))
        pred = (logit > 0).to(y.dtype)
        correct += float(((pred == y).to(y.dtype) * w).sum())
        total += float(w.sum())
        tpr.append(float((pred * y * w).sum() / (y * w).sum().clamp(min=1)))
        tnr.append(float(((1 - pred) * (1 - y) * w).sum() / ((1 - y) * w).sum().clamp(min=1)))
    if not losses:
        raise RuntimeError("warmstart_loss: no gated layer had labels")
    stats = {"accuracy": correct / max(total, 1.0),
             "balanced_accuracy": 0.5 * (sum(tpr) / len(tpr) + sum(tnr) / len(tnr))}
    return torch.stack(losses).mean(), stats
