"""A trained gate's scores ranked under a budget: the exact share, per KV head or over all layers.

Paper: KVzap (arXiv:2601.07891) thresholds its gate's scores, so the share it evicts follows
the prompt (up to 20% apart across prompts in its measurements); KVzip (arXiv:2505.23416)
ranks its scores over all layers and heads at once and cuts at the budget (kvpress's default).
This policy does the second with the first's scores: the gate scores every prompt token from
the full-attention prefill, the last ``window`` tokens and the gate's sinks stay, and the
budget's count goes to the highest scores, either within every KV head (``allocation
"head"``: every head evicts the same share) or over all layers and KV heads (``"global"``:
one cut for the whole prompt, so each prompt evicts exactly the target share and each layer
what its scores win). One shot at the prefill; decoding does not evict.

Why a raw score ranks across layers: KVzap's regression (``recipe.oracle_loss: mse_log``)
fits each layer's gate to the log KVzip+ score shifted by one constant per block for all
layers and heads, so the scores share one scale (``global_scores`` keeps them raw, as
``kvzip`` does). An attention-kind gate ranks the same way; its scores share no trained scale
across layers unless an oracle loss gave them one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.gate.apply import gate_ranking
from kvgate.policies.attention_gate import by_kv_head, checked_gate_config
from kvgate.policies.base import (
    AllocationOption,
    Budget,
    LayerPrompt,
    ScoredPolicy,
    check_int,
    last_real,
    resolve_share,
)


@dataclass
class GateRank(ScoredPolicy, AllocationOption):
    """The top-``B`` entries by the gate's raw score, the last ``window`` tokens and the
    gate's sinks forced in (``allocation``: per KV head or over all layers and heads)."""

    name = "gate_rank"
    needs_attention = False  # the gate reads hidden states, not the layer's attention
    needs_gate = True

    window: int = 128

    def __post_init__(self) -> None:
        self.check_allocation()
        check_int(self.name, "window", self.window, 0)

    def ranked(self, prompt: LayerPrompt) -> tuple[Tensor, Tensor]:
        """``([B, H_kv, n] float scores, [B, H_kv, n] bool forced)`` of the layer's prompt,
        computed once per layer call (``scores`` and ``forced`` both read them). An ungated
        layer forces every entry (it keeps everything, counted against a global budget)."""
        found = prompt.derived.get("gate_rank")
        if found is not None:
            return found
        checked_gate_config(self.name, prompt)
        hk = prompt.key.shape[1]
        scores, forced = gate_ranking(prompt.module, prompt.hidden, prompt.position_embeddings,
                                      prompt.valid, prompt=prompt.valid)
        recent = last_real(prompt.valid, resolve_share(self.window, prompt.n_real))
        forced = (forced[:, None, :] | recent).expand(-1, hk, -1)
        if scores is None:  # an ungated layer: every entry stays
            scores = torch.zeros(forced.shape, device=forced.device)
            forced = prompt.valid[:, None, :].expand_as(forced)
        else:  # a KV head's entry scores as its best query head's (the 'any' rule of the flags)
            scores = by_kv_head(scores.detach().float(), hk, "amax")
        found = prompt.derived["gate_rank"] = (scores, forced & prompt.valid[:, None, :])
        return found

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]``: the gate's raw score (higher = keep; garbage at padding)."""
        return self.ranked(prompt)[0]

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        """``[B, H_kv, n]`` bool: the last ``window`` real tokens and the gate's sinks."""
        return self.ranked(prompt)[1]

    def global_scores(self, scores: Tensor, candidates: Tensor) -> Tensor:
        """The raw scores: one trained scale across layers (see the module docstring)."""
        return scores.float()
