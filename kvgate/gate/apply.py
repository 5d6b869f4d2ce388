"""Runs a layer's gate and the gated attention; called by the kvgate attention router."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvgate.attention.masks import last_real, memoised
from kvgate.gate.settings import GateSettings


@dataclass
class GateRecord:
    """What the last forward decided in one layer (read by the eviction loss and by logging)."""

    gate: Tensor  # [B, H_gate, n] straight-through values (1 = keep)
    counted: Tensor  # [B, n] bool: real tokens whose flags count (padding and non-prompt excluded)
    forced: Tensor | None = None  # [B, n] bool: kept whatever the gate says (None: ungated)
    # [B, H_gate, n] raw scores whose gradient reaches this gate's parameters only (kept when
    # the router asks: the oracle objective, kvgate.recipes.oracle); None otherwise
    scores: Tensor | None = None


def straight_through(scores: Tensor, gamma: float, tau: float) -> Tensor:
    """Hard keep flags in the forward pass, the sigmoid's gradient in the backward pass."""
    soft = torch.sigmoid(scores + gamma)
    hard = (soft > tau).to(soft.dtype)
    return hard + soft - soft.detach()


def gate_attend_mask(valid: Tensor, prompt: Tensor | None, mode: str,
                     all_real: bool = False) -> Tensor | None:
    """Mask of the gate's own attention [B, 1, n, n] (None = plain causal, no padding).
    ``all_real``: the caller knows no token is padding (the layer got no mask), so ``valid``
    is not read back (on a GPU a device sync per layer)."""
    n = valid.shape[1]
    bidirectional = mode == "prompt_bidirectional" and prompt is not None
    if not bidirectional and (all_real or bool(valid.all())):
        return None  # checked before any n x n mask is built: at 4k that is 2% of a prefill
    eye = torch.eye(n, dtype=torch.bool, device=valid.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    if bidirectional:
        # prompt rows see the whole (real) prompt and nothing after it: answer tokens never
        # influence a prompt flag; rows after the prompt see causally (their flags are unused)
        inside = (prompt[:, :, None] & prompt[:, None, :])
        outside = (~prompt)[:, :, None] & causal
        attend = (inside | outside) & valid[:, None, :]
        return (attend | eye)[:, None]
    return ((causal & valid[:, None, :]) | eye)[:, None]


def gate_attention_mask(gate_mod: nn.Module, valid: Tensor, prompt: Tensor | None,
                        all_real: bool = False, memo: dict | None = None) -> Tensor | None:
    """The mask of a gate's own attention; None for a local kind, which attends to nothing
    (and so never builds the n x n mask). ``all_real`` as in ``gate_attend_mask``; ``memo``
    (one forward's, for the mask ``valid`` and ``prompt`` come from) keeps the mask for the
    next layer: every gated layer of a forward reads the same one."""
    if gate_mod.local:
        return None
    mode = "prompt_bidirectional" if gate_mod.bidirectional else "causal"
    return memoised(memo, ("gate attend", mode),
                    lambda: gate_attend_mask(valid, prompt, mode, all_real))


def compute_gate(module: nn.Module, hidden: Tensor, position_embeddings, valid: Tensor,
                 prompt: Tensor | None = None, tau: float | None = None,
                 own_scores: bool = False, graph: bool = False, all_real: bool = False,
                 memo: dict | None = None) -> GateRecord:
    """Straight-through keep flags of one layer: [B, H_gate, n], with sinks, padding and
    (with a gate attending over the whole prompt, or a full prefill) non-prompt tokens forced
    to 1. ``tau`` overrides the gate's keep threshold. ``own_scores``: the record
    also keeps the raw scores, with a gradient that reaches this gate alone. ``graph``: the
    gate's computation records autograd even under ``torch.no_grad()`` (a forward whose
    only losses read the gates: ``kvgate.gate.patch.gate_graph_only``). ``all_real``: no token
    is padding (``valid`` all true), known without reading it back. ``memo``: the forward's
    memo of the mask ``valid`` and ``prompt`` come from (``gate_attention_mask``)."""
    gate_mod = module.kv_gate
    counted = counted_tokens(gate_mod, valid, prompt)
    if module.layer_idx < gate_mod.config.ungated_layers:
        gate = torch.ones(valid.shape[0], gate_mod.out_heads, valid.shape[1], device=valid.device)
        return GateRecord(gate, counted)
    attend = gate_attention_mask(gate_mod, valid, prompt, all_real, memo)
    cfg = gate_mod.config
    forced = forced_tokens(cfg, valid, counted, prompt)
    with torch.enable_grad() if graph else nullcontext():
        scores = gate_mod.scores(hidden, position_embeddings, attend)
        gate = straight_through(scores, cfg.gamma, cfg.tau if tau is None else tau)
        gate = torch.where(forced[:, None, :], torch.ones_like(gate), gate)
    record = GateRecord(gate, counted, forced)
    if own_scores:
        # a target for the gate's score (oracle labels) must not move what feeds the gate
        # (LoRA, earlier layers' gates): the scores again from the input cut from its history;
        # no second pass where nothing upstream trains
        record.scores = (gate_mod.scores(hidden.detach(), position_embeddings, attend)
                         if hidden.requires_grad else scores)
    return record


def gate_ranking(module: nn.Module, hidden: Tensor, position_embeddings, valid: Tensor,
                 prompt: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
    """What ranking a layer's tokens by its gate needs (inference, no threshold): the raw scores
    [B, H_gate, n] (higher = keep; None in an ungated layer, which keeps everything) and the
    tokens the gate always keeps [B, n] (sinks, the one-shot recent tokens, non-prompt)."""
    gate_mod = module.kv_gate
    if module.layer_idx < gate_mod.config.ungated_layers:
        return None, valid
    scores = gate_mod.scores(hidden, position_embeddings,
                             gate_attention_mask(gate_mod, valid, prompt))
    counted = counted_tokens(gate_mod, valid, prompt)
    return scores, forced_tokens(gate_mod.config, valid, counted, prompt)


def counted_tokens(gate_mod: nn.Module, valid: Tensor, prompt: Tensor | None) -> Tensor:
    """[B, n] bool: the tokens whose flags count (padding and, when the gate acts on the
    prompt alone, non-prompt tokens excluded)."""
    if prompt is not None and (gate_mod.bidirectional or gate_mod.config.prefill == "full"):
        return valid & prompt  # only prompt tokens can be evicted
    return valid.clone()


def forced_tokens(cfg: GateSettings, valid: Tensor, counted: Tensor,
                  prompt: Tensor | None) -> Tensor:
    """[B, n] bool: tokens kept whatever the gate says (uncounted ones, sinks, and a one-shot
    gate's last ``recent`` prompt tokens)."""
    forced = ~counted
    if cfg.sinks:
        # the first `sinks` real tokens of each sequence (left padding shifts them)
        rank = torch.cumsum(valid.long(), -1)
        forced = forced | (valid & (rank <= cfg.sinks))
    if cfg.prefill == "full" and cfg.recent and prompt is not None:
        # one-shot: the last `recent` prompt tokens stay in the cache, as inference keeps them,
        # so training sees exactly the cache it will be used with (and counts them as kept)
        recent = torch.full((valid.shape[0],), cfg.recent, device=valid.device)
        forced = forced | last_real(prompt & valid, recent)[:, 0]
    return forced
