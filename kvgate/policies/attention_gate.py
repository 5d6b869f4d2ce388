"""The learned policy: keep flags from the Attention-Gates of a patched (exported) model.

Paper: "In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al. 2024,
arXiv:2410.12876. Rule: a small attention module per layer (the Attention-Gate) reads the
layer's input over the whole context and flags, per token and KV head, whether the entry is
kept; it is trained (continual pre-training or fine-tuning) together with an eviction loss, so
the model learns which entries it can do without.

The budget does not enter: the eviction ratio is whatever the gate learned, reported as
%Evict. The flags are applied *inside* the prefill as
the paper's eq. 5 (later prompt rows see only kept entries), then the cache is compacted to the
kept entries. Decode tokens are not gated. Every gate kind (``GateConfig.kind``) runs here;
a local kind (mlp, linear) can also evict while decoding: ``local_gate``.

``tail`` (inference option, default 0): the last prompt tokens (an int count or a float share
of the prompt) stay in the cache whatever the gate says, as every heuristic keeps its
observation / recent window. A causal gate flags each token when it is written and cannot know
which tokens will end the prompt; the tail supplies that. Tail tokens count as kept in %Evict.

``tau`` (inference option, default: the trained gate's): the keep threshold on
``sigmoid(score + gamma)``. A higher one evicts more, so one trained gate can be run at several
eviction ratios, the way a heuristic takes a budget; the gate never trained at that threshold.

``prefill`` (inference option, default: as the gate trained, ``GateConfig.prefill``):
``"gated"`` is the paper's in-prefill eviction above, which also saves prefill attention.
``"full"`` encodes the whole prompt with full causal attention and applies the gate's flags only
to what the cache keeps afterwards, exactly as every one-shot heuristic (H2O, SnapKV, ...) does:
the same prefill cost and the same decode cache as theirs, so a comparison at matched eviction
differs in the keep decision alone. A gate trained with eq. 5 and run with ``"full"`` reads
hidden states it did not see in training, so its eviction ratio can move a little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import Tensor

from kvgate.gate.apply import compute_gate
from kvgate.gate.config import GatePrefill
from kvgate.gate.kinds import gate_class
from kvgate.policies.base import (
    Budget,
    EncodeMasking,
    LayerPrompt,
    PolicyError,
    check_choice,
    check_share,
    last_real,
    option_error,
    resolve_share,
)


@dataclass
class AttentionGatePolicy(EncodeMasking):
    """Thresholded gate flags (+ the gate's protected recent tokens and the ``tail``)."""

    tail: float | int = 0
    tau: float | None = None
    prefill: str | None = None

    name = "attention_gate"
    needs_attention = False
    budget_free = True
    needs_gate = True

    def __post_init__(self) -> None:
        check_share(self.name, "tail", self.tail)
        if self.prefill is not None:
            check_choice(self.name, "prefill", self.prefill, get_args(GatePrefill))
        check_tau(self.name, self.tau)

    def keep(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """[B, H_kv, n] bool from the layer's gate (per-query-head gates: union over the
        group, since a KV entry must stay if any query head that reads it keeps it)."""
        self.gate_config(prompt)
        record = compute_gate(prompt.module, prompt.hidden, prompt.position_embeddings,
                              prompt.valid, prompt=prompt.valid, tau=self.tau)
        flags = by_kv_head(record.gate.detach() > 0.5, prompt.key.shape[1], "any")
        return (flags | self.protected(prompt)) & prompt.valid[:, None, :]

    def gate_config(self, prompt: LayerPrompt) -> Any:
        """The layer's ``GateConfig`` after checking that the prompt can run its gate."""
        return checked_gate_config(self.name, prompt)

    def encode_band(self, prompt: LayerPrompt) -> int | None:
        """``prefill="full"`` makes this a one-shot policy (full prefill attention, then the
        cache keeps the flagged entries); ``"gated"`` shows each query its last ``recent`` keys
        inside the prefill, as training did."""
        config = self.gate_config(prompt)
        return config.recent if (self.prefill or config.prefill) == "gated" else None

    def protected(self, prompt: LayerPrompt) -> Tensor:
        """[B, 1, n] bool: the last ``recent`` prompt tokens of the gate's config (every later
        query would see them anyway), or the inference-time ``tail`` if it is longer."""
        n_real = prompt.valid.sum(-1)
        recent = prompt.module.kv_gate.config.recent
        return last_real(prompt.valid, torch.maximum(resolve_share(self.tail, n_real),
                                                     resolve_share(recent, n_real)))


def check_tau(policy: str, tau: Any) -> None:
    """An inference keep threshold: None (the trained one) or a number in (0, 1)."""
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))
                            or not 0.0 < tau < 1.0):
        raise option_error(policy, "tau", "must be a number in (0, 1)", tau)


def checked_gate_config(policy: str, prompt: LayerPrompt) -> Any:
    """The ``GateConfig`` of the prompt's layer after checking that the prompt can run its
    gate (a gated layer, its hidden states, and the rotary tables an attention kind reads)."""
    module = prompt.module
    if module is None or not hasattr(module, "kv_gate"):
        raise PolicyError(f"policy {policy} needs a gated model: load an exported "
                          "checkpoint (--checkpoint DIR) or call kvgate.patch first")
    if prompt.hidden is None:
        raise PolicyError(f"policy {policy} needs the layer's hidden states")
    config = module.kv_gate.config
    rotary = gate_class(config.kind).rotary_dims(config.kind_settings(), prompt.query.shape[-1])
    if rotary and prompt.position_embeddings is None:
        raise PolicyError(f"policy {policy} needs the forward's rotary tables "
                          "(LayerPrompt.position_embeddings): the gate rotates its q/k")
    return config


def by_kv_head(x: Tensor, hk: int, reduce: str) -> Tensor:
    """[B, H_gate, n] -> [B, H_kv, n]: per-query-head gates reduced over each KV group."""
    if x.shape[1] == hk:
        return x
    return getattr(x.view(x.shape[0], hk, -1, x.shape[-1]), reduce)(2)
