"""KVzip: keep what the model needs to reconstruct the context (and KVzip+).

Paper: "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", Kim et al.
2025, arXiv:2505.23416 (kvpress's ``KVzipPress``). Rule: question-agnostic, one shot after the
whole prefill. The model reads a repeat request and then the context again, teacher forced,
over the cache holding the full context; an entry is worth keeping if some query of that
repeat pass attends to it. Score of entry i in (layer, KV head) = the largest attention
probability any repeat query j gives it, the max taken over the KV head's query group and
over j. The first ``sinks`` real tokens are always kept; the rest of the budget goes to the
highest scores. The repeat pass's own K/V are never stored (``PassScoring``).

The repeat pass, in chunks of ``chunk`` context tokens (each chunk one forward over the full
context cache, its own rows causal, attention normalised over the whole context and the
chunk's own rows): chunk 0 reads ``ask("Repeat the previous context exactly.")`` then its
tokens; chunk c > 0 reads ``ask("Repeat the part of the previous context exactly, starting
with", last 8 tokens of chunk c - 1)`` then its tokens (the paper's and kvpress's prompts).
``ask`` puts the request through the chat template where the tokenizer has one, as a question
is asked after a compressed context (``kvgate.inference.compress.run_passes``), else plainly
after a blank line. The whole real prompt is read again (kvpress skips the chat template's
head; the max over queries makes that a detail). Every row of a pass counts, request rows
included, as in kvpress. kvpress's scoring code normalises each chunk's softmax over the
sinks, the chunk's own context span and the repeat rows only; here it runs over the whole
stored context, as the paper states the rule and as the pass's forward attends.

``plus`` (KVzip+, "KVzap", arXiv:2601.07891): each attention weight ``a_ji`` is multiplied by
``||W_O^h v_i|| / ||h_j||`` before the max: the entry's contribution to the residual stream
through query head h's slice of the output projection, relative to the norm of query j's
hidden state (the normalised layer input, as kvpress reads it).

``allocation`` (``AllocationOption``): ``"head"`` (every KV head keeps the budget's count)
or ``"global"`` (one ranking over all layers and KV heads; kvpress's default). The scores are
attention probabilities (KVzip+: weighted ones), which compare across layers as they are:
``global_scores`` leaves them unchanged, as kvpress does.

``keep`` (one layer, no repeat pass: masked scoring) is a stand-in: the same rule with the
prompt read as its own repeat pass (each entry's largest causal attention from the prompt's
rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.attention.masks import first_real, left_pad
from kvgate.policies.base import (
    AllocationOption,
    Budget,
    LayerPrompt,
    PassAttention,
    PassScoring,
    PolicyError,
    ScoredPolicy,
    causal_probs,
    check_int,
    gqa_reduce,
    option_error,
    select_layers,
)
from kvgate.policies.contract import Ask

FIRST = "Repeat the previous context exactly."
LATER = "Repeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that prompt the next one
_ROWS = 512  # prompt rows per block of the one-shot stand-in


@dataclass
class KVzip(ScoredPolicy, PassScoring, AllocationOption):
    """Max attention of a teacher-forced repeat of the context, per (layer, KV head, entry)."""

    plus: bool = False
    chunk: int = 2048
    sinks: int = 4

    name = "kvzip"

    def __post_init__(self) -> None:
        self.check_allocation()
        if not isinstance(self.plus, bool):
            raise option_error(self.name, "plus", "must be true or false", self.plus)
        check_int(self.name, "chunk", self.chunk, 1)
        check_int(self.name, "sinks", self.sinks, 0)

    # ---------------------------------------------------------------- the repeat pass

    def passes(self, ids: Tensor, valid: Tensor, ask: Ask) -> list[tuple[Tensor, Tensor]]:
        """One pass per chunk of ``chunk`` real context tokens (a sample with fewer chunks has
        an all-padding row in the later passes). ids/valid [B, n] -> [(ids [B, m], valid
        [B, m])]."""
        rows = [row[ok].tolist() for row, ok in zip(ids.cpu(), valid.cpu())]  # per sample
        chunks = [[row[i:i + self.chunk] for i in range(0, len(row), self.chunk)]
                  for row in rows]
        first = list(ask(FIRST, ()))
        out = []
        for c in range(max(len(ch) for ch in chunks)):  # a loop over chunks
            batch = [[] if c >= len(ch) else
                     (first if c == 0 else list(ask(LATER, ch[c - 1][-OVERLAP:]))) + ch[c]
                     for ch in chunks]
            pass_ids, mask = left_pad(batch, 0)
            out.append((pass_ids.to(ids.device), mask.bool().to(ids.device)))
        return out

    def pass_scores(self, attention: PassAttention) -> Tensor:
        """Max over the block's real rows and each KV head's query group of the (KVzip+:
        weighted) attention probabilities: ``[B, H_kv, T]``."""
        p = attention.probs  # [B, H, r, T] fp32
        hk = attention.value.shape[1]
        if self.plus:
            p = p * self.contribution(attention)[:, :, None, :]
            if attention.hidden is None:
                raise PolicyError("kvzip plus=true needs the pass rows' hidden states")
            h_norm = attention.hidden.float().norm(dim=-1).clamp(min=1e-12)  # [B, r]
            p = p / h_norm[:, None, :, None]
        return gqa_reduce(p.amax(2), hk, "max")  # padding rows hold 0

    @staticmethod
    def contribution(attention: PassAttention) -> Tensor:
        """``||W_O^h v_i||`` for every query head h and stored entry i: ``[B, H, T]`` fp32,
        through ``v^T (W_O^h^T W_O^h) v`` (a d x d Gram matrix per head, never ``[.., D]``)."""
        proj = getattr(attention.module, "o_proj", None)
        if proj is None:
            raise PolicyError("kvzip plus=true needs the attention module's o_proj")
        v = attention.value.float()  # [B, Hk, T, d]
        b, hk, t, d = v.shape
        w = proj.weight.float()  # [D, H * d]
        h = w.shape[1] // d
        w = w.view(w.shape[0], h, d).permute(1, 2, 0)  # [H, d, D]
        gram = (w @ w.transpose(-1, -2)).view(hk, h // hk, d, d)
        sq = torch.einsum("bktd,kgde,bkte->bkgt", v, gram, v)
        return sq.clamp(min=0.0).sqrt().reshape(b, h, t)

    def pass_key(self) -> tuple:
        """The repeat pass depends on the chunk size alone."""
        return (self.name, self.chunk)

    def scorer_key(self) -> tuple:
        """KVzip and KVzip+ weigh the same attention differently; sinks, budget and
        allocation enter only the choice."""
        return (self.name, self.chunk, self.plus)

    def choose(self, scores: Tensor, valid: Tensor, budget: Budget) -> Tensor:
        """Sinks plus the highest scores, per head or over all layers and heads at once.
        scores [L, B, H_kv, T], valid [B, T] -> [L, B, H_kv, T] bool."""
        kept = budget.per_sample(valid.sum(-1))
        sinks = first_real(valid, torch.full_like(kept, self.sinks))  # [B, 1, T]
        forced = sinks[None].expand_as(scores)
        return select_layers(scores, kept, forced, valid, self.allocation)

    def global_scores(self, scores: Tensor, candidates: Tensor) -> Tensor:
        """Attention probabilities compare across layers as they are (kvpress ranks them
        raw)."""
        return scores.float()

    # ---------------------------------------------------------------- one-shot stand-in

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """The stand-in: each entry's largest causal attention from the prompt's own rows
        (max over rows and the query group), ``[B, H_kv, n]`` fp32."""
        n = prompt.query.shape[2]
        best = None
        for lo in range(0, n, _ROWS):  # blocks of rows bound the [B, H, rows, n] probabilities
            p = causal_probs(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                             slice(lo, min(n, lo + _ROWS))).amax(2)
            best = p if best is None else torch.maximum(best, p)
        return gqa_reduce(best, prompt.key.shape[1], "max")

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        count = torch.full((b,), self.sinks, dtype=torch.long, device=prompt.key.device)
        return first_real(prompt.valid, count).expand(b, hk, n)


__all__ = ["FIRST", "LATER", "OVERLAP", "KVzip"]
