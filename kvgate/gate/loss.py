"""Eviction loss ``alpha * |mean(gate) - beta|`` and the retention statistics behind it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvgate.gate.patch import gate_modules
from kvgate.gate.settings import GateSettings
from kvgate.models import dispatch


def gate_records(model: nn.Module):
    """(layer index, record) of every gated layer that ran in the last forward."""
    router = dispatch.router(model)
    return [] if router is None else sorted(router.records.items())


def last_flags(model: nn.Module) -> list[Tensor]:
    """The straight-through keep flags ``[B, H_gate, n]`` of every gated layer in the last
    forward, in layer order."""
    return [record.gate for _, record in gate_records(model)]


def retention_stats(model: nn.Module) -> dict[str, Tensor]:
    """Retention (mean keep flag) of the last forward over real, gated tokens.

    retention: scalar, mean over layers x gated heads x counted tokens (the loss's mean);
    retention_per_layer [L]; retention_per_head [L, H_gate]; evict_pct: 100 x the sample mean
    of per-sample eviction ratios (paper's %Evict; ungated layers count as kept).
    Only flags are read, so the values carry the straight-through gradient.
    """
    records = gate_records(model)
    if not records:
        raise RuntimeError("no gate decisions recorded: patch the model and run a forward first")
    gates = torch.stack([r.gate for _, r in records])  # [L, B, H, n]
    counted = records[0][1].counted.to(gates.dtype)  # [B, n], same for every layer
    per_tok = counted[None, :, None, :]
    denom_head = (per_tok.sum(-1).sum(1)).clamp(min=1)  # [1, H] -> tokens counted
    per_head = (gates * per_tok).sum(-1).sum(1) / denom_head  # [L, H]
    per_layer = per_head.mean(-1)
    retention = per_layer.mean()
    n_layers = len(gate_modules(model))
    per_sample = (gates.detach() * per_tok).sum((0, 2, 3)) / (
        counted.sum(-1).clamp(min=1) * gates.shape[2] * len(records))  # [B], gated layers
    ungated = n_layers - len(records)
    per_sample_all = (per_sample * len(records) + ungated) / n_layers
    return {
        "retention": retention,
        "retention_per_layer": per_layer,
        "retention_per_head": per_head,
        "evict_pct": 100.0 * (1.0 - per_sample_all.mean()),
    }


def eviction_loss(model: nn.Module, config: GateSettings | None = None,
                  attention_mask: Tensor | None = None,
                  beta: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``alpha * |retention - beta|`` from the flags recorded in the last forward.

    ``beta`` overrides ``config.beta`` (a retention schedule anneals it from 1.0, which the
    config itself may not hold since it checks beta <= tau). ``attention_mask`` is accepted
    for API symmetry; padding is already excluded through the recorded ``counted`` mask.
    """
    gates = gate_modules(model)
    if not gates:
        raise RuntimeError("eviction_loss: the model has no gates (call kvgate.patch first)")
    config = config or gates[0].config
    stats = retention_stats(model)
    target = config.beta if beta is None else float(beta)
    loss = config.alpha * (stats["retention"] - target).abs()
    return loss, stats


def clear_records(model: nn.Module) -> None:
    """Drop the stored flags (they hold the autograd graph of the last forward)."""
    router = dispatch.router(model)
    if router is not None:
        router.records.clear()
