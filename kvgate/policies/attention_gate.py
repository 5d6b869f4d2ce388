"""The learned policy: keep flags from the Attention-Gates of a patched (exported) model.

The gate decides per token and KV head; the budget does not enter (the eviction ratio is
whatever the gate learned, reported as %Evict), unless ``rank`` is set. The flags are applied
*inside* the prefill as the paper's eq. 5 (``encode_mask``: later prompt rows see only kept
entries), then the cache is compacted to the kept entries. Decode tokens are not gated.

``tail`` (inference option, default 0): the last prompt tokens (an int count or a float share
of the prompt) stay in the cache whatever the gate says, as every heuristic keeps its
observation / recent window. A causal gate flags each token when it is written and cannot know
which tokens will end the prompt; the tail supplies that. Tail tokens count as kept in %Evict.

``tau`` (inference option, default: the trained gate's): the keep threshold on
``sigmoid(score + gamma)``. A higher one evicts more, so one trained gate can be run at several
eviction ratios, the way a heuristic takes a budget; the gate never trained at that threshold.

``rank`` (inference option, default False): keep the entries with the highest gate scores at
the budget, per KV head, as a scored heuristic does, instead of thresholding. The gate's
protected tokens (sinks, recent, tail) come first and count towards the budget; an ungated layer
keeps everything. It runs a gate at exactly a heuristic's budget (the same kept count per head),
and at any eviction ratio without retraining. With per-query-head gates a KV entry scores the
maximum over its group, the ranking's form of the threshold's union.

``select`` (inference option, default ``"gate"``): which entries fill each head's count.
``"h2o"`` or ``"snapkv"`` keeps the gate's *number* of entries per (layer, KV head) and lets
that heuristic choose *which* ones (its scores and its recent or observation window at that
count), from a full prefill (one-shot, as the heuristic runs). ``select_options`` (a mapping,
JSON on the command line: ``select_options={"recent": 32}``) sets the heuristic's own options;
by default it runs with its defaults.
Beside ``rank`` (the gate's choice at a heuristic's uniform budget) it splits what a gate brings
into two parts measured apart: how it spreads the cache over layers and heads, and which
entries it keeps inside a head.

``prefill`` (inference option, default: as the gate trained, ``GateConfig.prefill``):
``"gated"`` is the paper's in-prefill eviction above, which also saves prefill attention.
``"full"`` encodes the whole prompt with full causal attention and applies the gate's flags only
to what the cache keeps afterwards, exactly as every one-shot heuristic (H2O, SnapKV, ...) does:
the same prefill cost and the same decode cache as theirs, so a comparison at matched eviction
differs in the keep decision alone. A gate trained with eq. 5 and run with ``"full"`` reads
hidden states it did not see in training, so its eviction ratio can move a little.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch import Tensor

from kvgate.gate.config import GatePrefill
from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    Policy,
    PolicyError,
    check_choice,
    check_share,
    keep_all,
    last_real,
    option_error,
    resolve_share,
    select_topk,
)
from kvgate.policies.registry import get_policy

# who chooses the entries inside the gate's counts: the gate itself, or a heuristic
SELECTORS = ("gate", "h2o", "snapkv")


@dataclass
class AttentionGatePolicy(Policy):
    name = "attention_gate"
    encode_mask = True
    needs_attention = False
    decode_eviction = False
    encode_recent = 0  # set from the gate's config by keep(): recent band inside the prefill
    tail: float | int = 0
    tau: float | None = None
    prefill: str | None = None
    rank: bool = False
    select: str = "gate"
    select_options: dict[str, Any] | None = None
    # the selector, built once from select / select_options (keep() runs once per layer)
    _chooser: Policy | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_share(self.name, "tail", self.tail)
        if not isinstance(self.rank, bool):
            raise option_error(self.name, "rank", "must be true or false", self.rank)
        if self.prefill is not None:
            check_choice(self.name, "prefill", self.prefill, get_args(GatePrefill))
        if self.tau is not None and (isinstance(self.tau, bool) or not isinstance(self.tau, (int, float))
                                     or not 0.0 < self.tau < 1.0):
            raise option_error(self.name, "tau", "must be a number in (0, 1)", self.tau)
        check_choice(self.name, "select", self.select, SELECTORS)
        if self.select != "gate":
            if self.rank:
                raise option_error(self.name, "select", "takes the gate's per-head counts; "
                                   "rank=true replaces them by the budget", self.select)
            if self.prefill == "gated":
                raise option_error(self.name, "prefill", f"must be full with select="
                                   f"{self.select} (the heuristic scores a full prefill)",
                                   self.prefill)
            self.prefill = "full"
            self.needs_attention = True  # the selector reads the prompt's attention
        self._chooser = self._build_chooser()
        if self.rank and self.tau is not None:
            raise option_error(self.name, "tau", "has no effect with rank=true (the budget sets "
                               "the eviction)", self.tau)

    def _build_chooser(self) -> Policy | None:
        options = self.select_options
        if self.select == "gate":
            if options is not None:
                raise option_error(self.name, "select_options", "needs select=h2o or "
                                   "select=snapkv (the gate itself takes no selector options)",
                                   options)
            return None
        if options is not None and not isinstance(options, dict):
            raise option_error(self.name, "select_options", "must be a mapping of the "
                               f"{self.select} options, e.g. {{\"recent\": 32}}", options)
        try:  # the registry checks the option names, the heuristic their values
            return get_policy(self.select, **(options or {}))
        except PolicyError as exc:
            raise option_error(self.name, "select_options", str(exc), options) from exc

    @property
    def budget_free(self) -> bool:  # a ranked gate is run at budgets, as the heuristics are
        return not self.rank

    def keep(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """[B, H_kv, n] bool from the layer's gate (per-query-head gates: union over the
        group, since a KV entry must stay if any query head that reads it keeps it)."""
        from kvgate.gate.apply import compute_gate, gate_ranking
        from kvgate.models.dispatch import context

        if self.rank and budget is None:
            raise PolicyError("policy attention_gate with rank=true keeps the top gate scores at "
                              "a budget: give one")
        module = prompt.module
        if module is None or not hasattr(module, "kv_gate"):
            raise PolicyError("policy attention_gate needs a gated model: load an exported "
                              "checkpoint (--checkpoint DIR) or call kvgate.patch first")
        if prompt.hidden is None:
            raise PolicyError("policy attention_gate needs the layer's hidden states")
        config = module.kv_gate.config
        # the caches read encode_mask per instance after keep(): "full" makes this a one-shot
        # policy (full prefill attention, then the cache keeps the flagged entries)
        self.encode_mask = (self.prefill or config.prefill) == "gated"
        # the prefill must show each query its last `recent` keys, as training did (the cache
        # reads this after keep())
        self.encode_recent = config.recent
        # the last `recent` prompt tokens stay (every later query would see them anyway), and
        # the inference-time tail if it is longer
        n_real = prompt.valid.sum(-1)
        last = last_real(prompt.valid, torch.maximum(resolve_share(self.tail, n_real),
                                                     resolve_share(config.recent, n_real)))
        hk = prompt.key.shape[1]
        position_embeddings = context(module).get("position_embeddings")
        # both read prompt=valid: at prefill the whole prompt is known, and a
        # prompt_bidirectional gate sees all of it
        if self.rank:
            scores, forced = gate_ranking(module, prompt.hidden, position_embeddings, prompt.valid,
                                          prompt=prompt.valid)
            if scores is None:
                return keep_all(prompt)
            scores = by_kv_head(scores, hk, "amax")
            forced = (forced[:, None, :] | last).expand_as(scores)
            return select_topk(scores, budget.per_sample(n_real), forced, prompt.valid)
        record = compute_gate(module, prompt.hidden, position_embeddings, prompt.valid,
                              prompt=prompt.valid, tau=self.tau)
        flags = by_kv_head(record.gate.detach() > 0.5, hk, "any")  # [B, H_kv, n]
        kept = (flags | last) & prompt.valid[:, None, :]
        if self.select == "gate":
            return kept
        # the gate's allocation, the heuristic's choice: same count per (row, KV head)
        chooser = self._chooser
        counts = kept.sum(-1)  # [B, H_kv]
        return select_topk(chooser.scores(prompt), counts, chooser.forced(prompt, counts),
                           prompt.valid)


def by_kv_head(x: Tensor, hk: int, reduce: str) -> Tensor:
    """[B, H_gate, n] -> [B, H_kv, n]: per-query-head gates reduced over each KV group."""
    if x.shape[1] == hk:
        return x
    return getattr(x.view(x.shape[0], hk, -1, x.shape[-1]), reduce)(2)
