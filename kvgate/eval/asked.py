"""One tokenised example asked under a policy, the two ways long-context benchmarks ask it.

- question-agnostic (the field's setting: kvpress, RULER under eviction): the policy compresses
  the context alone (:func:`kvgate.inference.compress.prefill_rows`), then the question is fed
  over the compressed cache and the answer decoded (``answer_rows``), so the policy never sees
  the question; :func:`ask_shared` does this for several one-shot policies from one prefill
  (or several ``PassScoring`` ones from one prefill and one run of their passes);
- query-aware: context and question are prefilled together under the policy, which then sees
  the question, and decoding follows (``decode_after``).

Either way the answer is asked as ``generate`` (greedy decoding, ``kvgate.inference.decode``)
and / or ``teacher`` (:mod:`kvgate.eval.teacher`: the gold answers fed once). Each returns an
:class:`Asked`: what a benchmark record needs besides its score.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.eval.errors import model_shape
from kvgate.eval.teacher import LEAD_TOKENS, TeacherScore, teacher_scores
from kvgate.policies.base import Budget, Policy
from kvgate.policies.contract import DecodeEvicting


@dataclass(frozen=True)
class Question:
    """What is asked after the context: its tokens, the tokens to generate, and the gold
    answers' tokens and texts (teacher scoring; the texts let it feed an answer after the
    model's lead-in, :mod:`kvgate.eval.teacher`)."""

    ids: tuple[int, ...]
    max_new_tokens: int
    answers: tuple[tuple[int, ...], ...] = ()
    texts: tuple[str, ...] = ()


@dataclass
class Asked:
    text: str | None  # None when nothing was generated (teacher scoring only)
    kept: int
    total: int
    seconds: float
    teacher: list[TeacherScore] = field(default_factory=list)  # one per gold answer
    answer_seconds: float = 0.0  # of ``seconds``, the answer's (its share of a batch's)

    def record(self) -> dict[str, Any]:
        """The fields every benchmark record stores: answer, kept / total entries, eviction
        share and seconds (each benchmark adds its score and its own fields)."""
        out = {"kept": self.kept, "total": self.total,
               "evict": 1.0 - self.kept / max(self.total, 1), "seconds": self.seconds}
        if self.text is not None:
            out["output"] = self.text
        return out


def _engine(model: nn.Module, tokenizer: Any, policy: Policy | str = "full",
            budget: Budget | float = 1.0, kv: KVQuant | None = None) -> Any:
    from kvgate.inference import Engine

    return Engine(model, tokenizer, policy, budget, **({} if kv is None else kv.kwargs()))


def _ask(engine: Any, compressed: Any, question: Question, scores: Sequence[str],
         rows: int = 1) -> tuple[list[str | None], list[list[TeacherScore]]]:
    """The question over ``compressed`` (``rows`` contexts, the same question each)."""
    from kvgate.inference.compress import answer_rows

    texts: list[str | None] = [None] * rows
    ids = None
    if "generate" in scores:
        ids = answer_rows(engine, compressed, [list(question.ids)] * rows,
                          question.max_new_tokens)
        texts = [engine.tokenizer.decode(row, skip_special_tokens=True) for row in ids]
    teacher = [[] for _ in range(rows)]
    if "teacher" in scores:  # the generation's start is the lead-in, when long enough
        greedy = ids if question.max_new_tokens >= LEAD_TOKENS else None
        teacher = teacher_scores(engine, compressed, question, greedy=greedy)
    return texts, teacher


def _kept(model: nn.Module, compressed: Any) -> tuple[int, int]:
    layers, heads = model_shape(model)
    total = layers * heads * compressed.lengths[0]
    return round(compressed.kept_fraction * total), total


def ask_agnostic(model: nn.Module, tokenizer: Any, context: Sequence[int], question: Question,
                 policy: Policy, budget: Budget, scores: Sequence[str],
                 kv: KVQuant | None = None) -> Asked:
    """Compress ``context``, then ask ``question`` over the compressed cache (``kv``: how it
    stores kept entries, every ``ask_*`` alike; None: as the model gives them)."""
    from kvgate.inference.compress import prefill_rows

    engine = _engine(model, tokenizer, policy, budget, kv)
    t0 = time.perf_counter()
    compressed, _ = prefill_rows(engine, [list(context)], engine.new_cache())
    t1 = time.perf_counter()
    texts, teacher = _ask(engine, compressed, question, scores)
    t2 = time.perf_counter()
    return Asked(texts[0], *_kept(model, compressed), t2 - t0, teacher[0], t2 - t1)


def ask_shared(model: nn.Module, tokenizer: Any, context: Sequence[int], question: Question,
               variants: Mapping[str, tuple[Policy, Budget]],
               scores: Sequence[str], kv: KVQuant | None = None) -> dict[str, Asked]:
    """:func:`ask_agnostic` for several one-shot ``variants[name] = (policy, budget)``: one
    shared prefill (``kvgate.cache.shared.SharedPrefill``; ``PassScoring`` variants that read
    the same passes: ``kvgate.cache.shared_passes.SharedPasses``), then the question over every
    compressed cache at once, as the rows of one batch (``kvgate.cache.fork.stack_caches``; a
    decode-evicting policy's budgets form a batch of their own, decoded under it). The answers
    are each variant's own run's, up to the float rounding a batch may change. A variant's
    seconds are its share of the run: the prefill less the other variants' choosing, plus its
    batch's answer divided by the batch size."""
    from kvgate.cache.fork import stack_caches
    from kvgate.inference.compress import CompressedContext, compress_rows_shared

    engine = _engine(model, tokenizer, kv=kv)
    t0 = time.perf_counter()
    compressed, own = compress_rows_shared(engine, [list(context)], variants)
    prefill = time.perf_counter() - t0 - sum(own.values())
    # generation decodes each decode-evicting policy's rows under it; teacher scoring alone
    # appends under every policy, so all variants answer as one batch
    append_only = "generate" not in scores
    groups: dict[Any, list[str]] = {}
    for name, (policy, _) in variants.items():
        evicting = isinstance(policy, DecodeEvicting) and not append_only
        groups.setdefault(id(policy) if evicting else None, []).append(name)
    out = {}
    for names in groups.values():
        t1 = time.perf_counter()
        one = compressed[names[0]]
        rows = len(names)
        batch = CompressedContext(stack_caches([compressed[n].cache for n in names],
                                               append_only),
                                  one.input_ids.expand(rows, -1),
                                  one.attention_mask.expand(rows, -1), one.chat, one.suffix)
        texts, teacher = _ask(engine, batch, question, scores, rows)
        share = (time.perf_counter() - t1) / rows
        for i, name in enumerate(names):
            out[name] = Asked(texts[i], *_kept(model, compressed[name]),
                              prefill + own[name] + share, teacher[i], share)
    return {name: out[name] for name in variants}


def ask_query_aware(model: nn.Module, tokenizer: Any, context: Sequence[int],
                    question: Question, policy: Policy, budget: Budget,
                    scores: Sequence[str], kv: KVQuant | None = None) -> Asked:
    """Prefill context and question together under the policy, then feed the gold answers
    over forks of the cache (teacher) and / or decode (generate)."""
    import torch

    from kvgate.inference.compress import decode_after, prefill_rows

    engine = _engine(model, tokenizer, policy, budget, kv)
    t0 = time.perf_counter()
    with torch.no_grad():
        compressed, out = prefill_rows(engine, [list(context) + list(question.ids)],
                                       engine.new_cache())
    kept, total = _kept(model, compressed)
    teacher = []
    if "teacher" in scores:  # first: decoding below grows the cache
        asked = Question((), question.max_new_tokens, question.answers, question.texts)
        teacher = teacher_scores(engine, compressed, asked, first=out.logits[:, -1])[0]
    text = None
    if "generate" in scores:
        mask = compressed.attention_mask
        with torch.no_grad():
            ids = decode_after(engine, out, mask, mask.sum(-1, keepdim=True), compressed.cache,
                               question.max_new_tokens)
        text = tokenizer.decode(ids[0], skip_special_tokens=True)
    return Asked(text, kept, total, time.perf_counter() - t0, teacher)
