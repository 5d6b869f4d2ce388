"""Research hybrids of the learned gate and the heuristics: the gate at a budget, or the gate's
per-head counts filled by a heuristic's choice. Kept out of the package (issue #62): tables of
docs/RESULTS.md were measured with it, so ``experiments/policies.register()`` adds it to
kvgate's registry as ``gate_hybrid``, which ``experiments/research_cli.py`` (``kvgate`` with
the research policies; what experiments/run_results.sh runs) does first.

Paper: the gate of "In-context KV-Cache Eviction for LLMs via Attention-Gate", Zeng et al.
2024, arXiv:2410.12876 (see ``attention_gate``); the hybrids are ours, made to measure apart
what a trained gate brings. ``tail``, ``tau`` and ``prefill`` mean what they mean for
``attention_gate``; with the two switches below at their defaults this policy *is*
``attention_gate``.

``rank`` (default False): keep the entries with the highest gate scores at the budget, per KV
head, as a scored heuristic does, instead of thresholding. The gate's protected tokens (sinks,
recent, tail) come first and count towards the budget; an ungated layer keeps everything. It
runs a gate at exactly a heuristic's budget (the same kept count per head), and at any eviction
ratio without retraining. With per-query-head gates a KV entry scores the maximum over its
group, the ranking's form of the threshold's union.

``select`` (default ``"gate"``): which entries fill each head's count. ``"h2o"`` or
``"snapkv"`` keeps the gate's *number* of entries per (layer, KV head) and lets that heuristic
choose *which* ones (its scores and its recent or observation window at that count), from a
full prefill (one-shot, as the heuristic runs). ``select_options`` (a mapping, JSON on the
command line: ``select_options={"recent": 32}``) sets the heuristic's own options; by default
it runs with its defaults.
Beside ``rank`` (the gate's choice at a heuristic's uniform budget) it splits what a gate brings
into two parts measured apart: how it spreads the cache over layers and heads, and which
entries it keeps inside a head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from kvgate.gate.apply import gate_ranking
from kvgate.policies.attention_gate import AttentionGatePolicy, by_kv_head
from kvgate.policies.base import (
    Budget,
    LayerPrompt,
    PolicyError,
    ScoredPolicy,
    check_choice,
    keep_all,
    make_policy,
    option_error,
    select_topk,
)
from kvgate.policies.h2o import H2O
from kvgate.policies.snapkv import SnapKV

# who chooses the entries inside the gate's counts: the gate itself, or a heuristic
SELECTORS: dict[str, type[ScoredPolicy] | None] = {"gate": None, "h2o": H2O, "snapkv": SnapKV}


@dataclass
class GateHybrid(AttentionGatePolicy):
    """``attention_gate`` plus ``rank`` (the top gate scores at the budget) and ``select`` (the
    gate's per-head counts, a heuristic's entries)."""

    rank: bool = False
    select: str = "gate"
    select_options: dict[str, Any] | None = None
    # the selector, built once from select / select_options (keep() runs once per layer)
    _chooser: ScoredPolicy | None = field(default=None, init=False, repr=False, compare=False)

    name = "gate_hybrid"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rank, bool):
            raise option_error(self.name, "rank", "must be true or false", self.rank)
        check_choice(self.name, "select", self.select, tuple(SELECTORS))
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

    def _build_chooser(self) -> ScoredPolicy | None:
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
        try:  # option names are checked as the registry checks them, values by the heuristic
            return make_policy(SELECTORS[self.select], **(options or {}))
        except PolicyError as exc:
            raise option_error(self.name, "select_options", str(exc), options) from exc

    @property
    def budget_free(self) -> bool:  # a ranked gate is run at budgets, as the heuristics are
        return not self.rank

    def keep(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """[B, H_kv, n] bool: the ranked gate at ``budget``, the thresholded gate, or the
        thresholded gate's per-head counts filled by the selector."""
        if self.rank:
            if budget is None:
                raise PolicyError(f"policy {self.name} with rank=true keeps the top gate scores "
                                  "at a budget: give one")
            return self._ranked(prompt, budget)
        kept = super().keep(prompt, budget)
        if self._chooser is None:
            return kept
        # the gate's allocation, the heuristic's choice: same count per (row, KV head)
        counts = kept.sum(-1)  # [B, H_kv]
        return select_topk(self._chooser.scores(prompt), counts,
                           self._chooser.forced(prompt, counts), prompt.valid)

    def _ranked(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        self.gate_config(prompt)
        # prompt=valid: at prefill the whole prompt is known (a prompt_bidirectional gate sees
        # all of it)
        scores, forced = gate_ranking(prompt.module, prompt.hidden, prompt.position_embeddings,
                                      prompt.valid, prompt=prompt.valid)
        if scores is None:
            return keep_all(prompt)
        scores = by_kv_head(scores, prompt.key.shape[1], "amax")
        forced = (forced[:, None, :] | self.protected(prompt)).expand_as(scores)
        return select_topk(scores, budget.per_sample(prompt.n_real), forced, prompt.valid)
