"""The local gates' policy: threshold plus recent window, at the prefill and while decoding.

Paper: KVzap (arXiv:2601.07891). A local gate (``GateConfig.kind`` mlp or linear) scores each
token from its own normalised hidden state, so it can score a token when the token is written,
also while decoding. Rule: an entry stays if its keep probability ``sigmoid(score + gamma)``
exceeds ``tau`` or if it is among the last ``window`` tokens (KVzap: 128); a generated token is
scored when it is written and evicted once it leaves the window if it is below the threshold.
The cache therefore holds, per KV head, the entries above the threshold plus the window. The
Attention-Gate (Zeng et al. 2024, arXiv:2410.12876; ``attention_gate``) reads the tokens
before each one and keeps every generated token; it runs local gates too, at the prefill only.

``prefill`` (default: as the gate trained, ``GateConfig.prefill``): ``"gated"`` encodes the
prompt under eq. 5 with a band of ``window + 1`` keys, so each prompt row sees what a decoding
row at its place sees (the entries kept so far, the last ``window`` tokens and itself): the
prefill then equals feeding the prompt token by token. A gate trained with
``gate.recent = window + 1`` trained on exactly that cache. ``"full"`` encodes the prompt with
full attention and thresholds the stored entries afterwards, as KVzap's prefill does.

``tau`` (default: the trained gate's) dials the threshold as for ``attention_gate``;
``threshold`` instead states it in KVzap's units, on the raw score: an entry stays when its
score is at least ``threshold`` (KVzap's README: -4), exactly as KVzap's rule reads (one or the
other, not both). The budget does not enter (``budget_free``): the eviction ratio is what the gate's scores give.
The gate's ``sinks`` are the prompt's first tokens and stay (decode rows are never sinks), as
do the last ``recent`` prompt tokens of a gate trained one-shot (``GateConfig.prefill`` full),
which it trained to keep.

``interval`` (default 16): while decoding, the rule runs once every ``interval`` new rows
instead of after every one, as kvpress's ``DecodingPress`` compresses every
``compression_interval`` steps (``RowScoring.interval``): the rows written since the last
round are scored by one call of the gate (one matrix product over ``interval`` rows instead of
``interval`` products over one) and the tokens that left the window meanwhile go in one round.
The kept set right after a round is the one the rule gives evicting step by step; between
rounds up to ``interval - 1`` tokens that left the window wait, so a decoding row sees at most
the last ``window + interval - 1`` tokens besides the entries above the threshold. 1: the rule
after every step (as before the option, and how the stored results were decoded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import Tensor

from kvgate.gate.apply import compute_gate, gate_ranking
from kvgate.gate.config import GatePrefill
from kvgate.policies.attention_gate import by_kv_head, check_tau, checked_gate_config
from kvgate.policies.base import (
    Budget,
    EncodeMasking,
    LayerPrompt,
    PolicyError,
    RowScoring,
    check_choice,
    check_decode,
    check_int,
    last_real,
    option_error,
    resolve_share,
    stat,
)


@dataclass
class LocalGatePolicy(EncodeMasking, RowScoring):
    """Entries above the local gate's threshold plus the last ``window`` tokens, kept at the
    prefill and held so while decoding (``RowScoring``: each new token scores itself)."""

    tau: float | None = None
    window: int = 128
    prefill: str | None = None
    # KVzap's rule: keep a raw score >= threshold (tau's twin); stored only when set, so the
    # results stored before it existed still match
    threshold: float | None = field(default=None, metadata={"omit_default": True})
    # decode rows per eviction round; left out of the stored spec at 1, the behaviour of the
    # results stored before it existed, so that those match only runs that decode alike
    interval: int = field(default=16, metadata={"omit_at": 1})

    name = "local_gate"
    needs_attention = False
    budget_free = True
    needs_gate = True

    def __post_init__(self) -> None:
        check_tau(self.name, self.tau)
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                    or not math.isfinite(self.threshold):
                raise option_error(self.name, "threshold", "must be a finite number (a raw "
                                   "score, e.g. -4)", self.threshold)
            if self.tau is not None:
                raise PolicyError(f"policy {self.name}: give tau (a keep probability) or "
                                  "threshold (a raw score, KVzap's units), not both")
        check_int(self.name, "window", self.window, 0)
        check_int(self.name, "interval", self.interval, 1)
        if self.prefill is not None:
            check_choice(self.name, "prefill", self.prefill, get_args(GatePrefill))

    def gate_config(self, prompt: LayerPrompt) -> Any:
        """The layer's ``GateConfig`` after checking that its gate is a local kind."""
        config = checked_gate_config(self.name, prompt)
        if not prompt.module.kv_gate.local:
            raise PolicyError(f"policy {self.name} needs a local gate (kind mlp or linear); this "
                              f"model's gates are kind {config.kind!r}: use attention_gate")
        return config

    def keep(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]`` bool: above the threshold, or among the last ``window`` tokens."""
        recent = last_real(prompt.valid, resolve_share(self.window, prompt.n_real))
        return (self.above(prompt) | recent) & prompt.valid[:, None, :]

    def encode_band(self, prompt: LayerPrompt) -> int | None:
        config = self.gate_config(prompt)
        return self.window + 1 if (self.prefill or config.prefill) == "gated" else None

    def above(self, prompt: LayerPrompt) -> Tensor:
        """``[B, H_kv, n]`` bool: the prompt entries the gate keeps on its own (its threshold,
        its sinks, every entry of an ungated layer); computed once per layer call."""
        found = prompt.derived.get("gate_above")
        if found is None:
            self.gate_config(prompt)
            if self.threshold is None:
                record = compute_gate(prompt.module, prompt.hidden, prompt.position_embeddings,
                                      prompt.valid, prompt=prompt.valid, tau=self.tau)
                flags = record.gate.detach() > 0.5
            else:  # the raw scores against KVzap's threshold; sinks and the like still stay
                scores, forced = gate_ranking(prompt.module, prompt.hidden,
                                              prompt.position_embeddings, prompt.valid,
                                              prompt=prompt.valid)
                flags = (forced[:, None, :].expand(-1, prompt.key.shape[1], -1)
                         if scores is None else (scores >= self.threshold) | forced[:, None, :])
            flags = by_kv_head(flags, prompt.key.shape[1], "any")
            found = prompt.derived["gate_above"] = flags & prompt.valid[:, None, :]
        return found

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        """``{"above": [B, H_kv, n]}`` 1.0 where the gate keeps the entry on its own."""
        return {"above": self.above(prompt).float()}

    def row_stats(self, rows: LayerPrompt) -> dict[str, Tensor]:
        """``{"above": [B, H_kv, r]}`` of new rows: each scored from its own hidden state."""
        module = rows.module
        gate = getattr(module, "kv_gate", None)
        if gate is None or not gate.local or rows.hidden is None:
            self.gate_config(rows)  # the check, with its one-line error (a local gate passes)
        b, hk, r = rows.key.shape[:3]
        if module.layer_idx < gate.config.ungated_layers:
            flags = torch.ones(b, hk, r, dtype=torch.bool, device=rows.key.device)
        else:
            scores = gate.scores(rows.hidden)
            if self.threshold is None:  # Gate.forward's hard flags, without its gradient terms
                tau = gate.config.tau if self.tau is None else self.tau
                kept = torch.sigmoid(scores + gate.config.gamma) > tau
            else:
                kept = scores >= self.threshold
            flags = by_kv_head(kept, hk, "any")
        return {"above": (flags & rows.valid[:, None, :]).float()}

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Keep the slots above the threshold and the last ``window`` tokens by position;
        ``capacity`` is not read (the rule sets the size). Returns (stats, [B, H_kv, T])."""
        check_decode(logits, valid, positions, capacity)
        newest = positions.amax(-1, keepdim=True)  # every head holds the newest token
        recent = positions > newest - self.window
        return stats, valid & ((stat(stats, "above", valid) > 0.5) | recent)
