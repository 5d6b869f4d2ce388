"""``kvgate eval ruler``: RULER-style tasks under eviction, question-agnostic by default.

Each (task, length) gets ``limit`` examples (:func:`kvgate.eval.ruler.tasks.generate`, seeds
0..limit-1; a needle family's example ``s`` sits at ``depths[s % len(depths)]``, the other
families draw their own depths). Per policy and budget, every example is scored one at a time:

- question-agnostic (the default, key mode ``agnostic``): the context is compressed with
  ``Engine.compress`` (the policy never sees the question), then ``Engine.answer`` asks the
  question (with the task's answer prefix) over the compressed cache and decodes greedily;
- query-aware (``--query-aware``, key mode ``query-aware``): the same tokens, context and
  question, are prefilled together under the policy (which then sees the question), then
  decoded greedily (:func:`kvgate.eval.needle.generate_greedy`).

The answer is scored with RULER's metric of the task (``string_match_all`` /
``string_match_part``, in %); each example's record holds the answer text, the score, the kept
share and the seconds of compress + answer. Keys: ``ruler|TASK@LENGTH|POLICY|BUDGET|MODE``.
Every prompt (context, question, answer prefix and the tokens to generate) must fit the model's
context: a length that does not is refused before anything is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from kvgate.cache.shared import shares_prefill
from kvgate.eval.asked import (
    Asked,
    compress_shared_then_answer,
    compress_then_answer,
    prefill_then_decode,
)
from kvgate.eval.intervals import mean_interval
from kvgate.eval.multiple_choice import evict_summary, run_resumable
from kvgate.eval.report import ResultStore, budget_label, make_key
from kvgate.eval.ruler.scoring import score
from kvgate.eval.ruler.tasks import NIAH, TASKS, RulerExample, generate
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.policies.base import Budget, Policy

# RULER's tokens_to_generate per family (scripts/synthetic.yaml); --max-new-tokens caps them
MAX_NEW_TOKENS = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32,
                  "qa_2": 32}
NEEDLE_FAMILIES = tuple(NIAH)
MODES = ("agnostic", "query-aware")


@dataclass(frozen=True)
class RulerItem:
    """One example with its tokens: ``ids`` = context part + question part (the digest and
    the batching size read it), ``n_ctx`` of them the context part."""

    uid: str
    example: RulerExample
    ids: tuple[int, ...]
    n_ctx: int
    depth: float | None  # as asked (%), None when the family draws its own
    max_new_tokens: int


def task_max_new_tokens(task: str, cap: int | None = None) -> int:
    n = MAX_NEW_TOKENS[task]
    return n if cap is None else min(n, cap)


def prompt_ids(tokenizer: Any, example: RulerExample, chat: bool) -> tuple[list[int], list[int]]:
    """(context part, question part) token ids exactly as ``Engine.compress`` / ``answer``
    build them (chat template when the tokenizer has one and ``chat``)."""
    from kvgate.inference.compress import has_chat_template, split_prompt

    chat = chat and has_chat_template(tokenizer)
    ctx, question = split_prompt(tokenizer, example.context, example.question,
                                 example.answer_prefix, chat)
    ctx_ids = tokenizer(ctx, add_special_tokens=not chat)["input_ids"]
    return list(ctx_ids), list(tokenizer(question, add_special_tokens=False)["input_ids"])


def _examples(task: str, tokenizer: Any, length: int, depths: Sequence[float], limit: int,
              seed: int, source: str) -> list[tuple[str, RulerExample, float | None, int | None]]:
    """(uid suffix, example, depth asked, tokens to generate or None) of (task, length):
    generated here (``source="generated"``), or read from kvpress's RULER (``"hub"`` or a
    ``save_to_disk`` folder of it, where the length is the dataset's and depths are its own)."""
    if source == "generated":
        out = []
        for s in range(limit):
            depth = float(depths[s % len(depths)]) if task in NIAH else None
            ex = generate(task, tokenizer, length, None if depth is None else depth / 100.0,
                          seed=seed + s)
            out.append((f"{s}" + ("" if depth is None else f":d{depth:g}"), ex, depth, None))
        return out
    from kvgate.data.longctx import load_ruler

    return [(f"{x.id}", RulerExample(task, x.context, x.question, x.answer_prefix,
                                     list(x.answers), length), None, x.max_new_tokens)
            for x in load_ruler(length, tasks=[task], source=source, limit=limit)]


def build_items(tokenizer: Any, task: str, length: int, depths: Sequence[float], limit: int,
                seed: int = 0, chat: bool = True, max_new_cap: int | None = None,
                model_limit: int | None = None, source: str = "generated") -> list[RulerItem]:
    """The ``limit`` examples of (task, length); ``InputTooLongError`` when a prompt and its
    answer tokens overrun ``model_limit``."""
    items = []
    for suffix, ex, depth, own_new in _examples(task, tokenizer, length, depths, limit, seed,
                                                source):
        new = task_max_new_tokens(task, max_new_cap) if own_new is None else (
            own_new if max_new_cap is None else min(own_new, max_new_cap))
        ctx, question = prompt_ids(tokenizer, ex, chat)
        total = len(ctx) + len(question) + new
        if model_limit is not None and total > model_limit:
            raise InputTooLongError(
                f"ruler {task} at length {length:,}: the prompt has {len(ctx) + len(question):,}"
                f" tokens + {new} new tokens = {total:,}; the model takes at most "
                f"{model_limit:,} (max_position_embeddings): use --lengths of at most "
                f"{max(0, length - (total - model_limit)):,}")
        uid = f"{task}@{length}:{suffix}"
        items.append(RulerItem(uid, ex, tuple(ctx + question), len(ctx), depth, new))
    return items


def ruler_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean RULER score (%), its 95% interval, %Evict and seconds per example."""
    scores = [float(r["score"]) for r in records.values()]
    n = len(scores)
    lo, hi = mean_interval(scores) if n else (float("nan"), float("nan"))
    secs = [float(r["seconds"]) for r in records.values()]
    return {"n": n, "acc": sum(scores) / n if n else float("nan"), "ci_low": lo, "ci_high": hi,
            "sec_per_example": sum(secs) / n if n else float("nan"), **evict_summary(records)}


def _record(item: RulerItem, asked: Asked) -> dict[str, Any]:
    ex = item.example
    return {**asked.record(), "answers": list(ex.answers),
            "score": score(ex.task, [asked.text], [ex.answers]), "depth": item.depth,
            "n_ctx": item.n_ctx}


def score_agnostic(model: nn.Module, tokenizer: Any, item: RulerItem, policy: Policy,
                   budget: Budget, chat: bool) -> dict[str, Any]:
    """Compress the context, then ask the question over the compressed cache."""
    ex = item.example
    return _record(item, compress_then_answer(model, tokenizer, ex.context, ex.question,
                                              ex.answer_prefix, item.max_new_tokens, policy,
                                              budget, chat))


def score_shared(model: nn.Module, tokenizer: Any, item: RulerItem,
                 variants: Mapping[str, tuple[Policy, Budget]], chat: bool,
                 ) -> dict[str, dict[str, Any]]:
    """:func:`score_agnostic` for several one-shot policies from one prefill: a record per
    variant, each equal to its own run's (its seconds are the shared prefill less the other
    variants' choosing, plus its answer)."""
    ex = item.example
    asked = compress_shared_then_answer(model, tokenizer, ex.context, ex.question,
                                        ex.answer_prefix, item.max_new_tokens, variants, chat)
    return {k: {**_record(item, a), "shared_prefill": len(variants)} for k, a in asked.items()}


def score_query_aware(model: nn.Module, tokenizer: Any, item: RulerItem, policy: Policy,
                      budget: Budget) -> dict[str, Any]:
    """Prefill context and question together under the policy, then decode."""
    return _record(item, prefill_then_decode(model, tokenizer, item.ids, item.max_new_tokens,
                                             policy, budget))


def evaluate_ruler(model: nn.Module, tokenizer: Any, tasks: Sequence[str],
                   lengths: Sequence[int], policies: Mapping[str, Policy],
                   budgets: Sequence[Budget], store: ResultStore, *,
                   depths: Sequence[float] = (0, 25, 50, 75, 100), limit: int = 5,
                   query_aware: bool = False, chat: bool = True, seed: int = 0,
                   max_new_tokens: int | None = None, progress: bool = True,
                   source: str = "generated") -> list[str]:
    """Score every (task, length, policy, budget); returns the result keys. Every cell is
    built (and checked to fit the model) before anything is scored."""
    for task in tasks:
        if task not in TASKS:
            from kvgate.eval.ruler.haystack import RulerError

            raise RulerError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if getattr(tokenizer, "pad_token", "") is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_limit = context_limit(model.config)
    cells = [(task, int(length), build_items(tokenizer, task, int(length), depths, limit, seed,
                                             chat, max_new_tokens, model_limit, source))
             for length in lengths for task in tasks]
    mode = MODES[1] if query_aware else MODES[0]
    keys = []
    for task, length, items in cells:
        keys += _score_cell(model, tokenizer, store, task, length, items, policies, budgets,
                            mode, chat, progress)
    return keys


def _score_cell(model: nn.Module, tokenizer: Any, store: ResultStore, task: str, length: int,
                items: list[RulerItem], policies: Mapping[str, Policy],
                budgets: Sequence[Budget], mode: str, chat: bool, progress: bool) -> list[str]:
    """Every (policy, budget) of one (task, length), each under its resumable key."""
    query_aware = mode == MODES[1]
    extra = {"family": task, "length": length, "query_aware": query_aware}
    jobs = [(make_key("ruler", f"{task}@{length}", name, budget_label(bud), mode), policy,
             bud or Budget(ratio=1.0))
            for name, policy in policies.items()
            for bud in ([None] if policy.budget_free else budgets)]
    # question-agnostic one-shot policies share each example's prefill (SharedPrefill): the
    # first key that needs an example scores it for every shared key still lacking it
    shared = {key: (policy, fixed) for key, policy, fixed in jobs
              if not query_aware and shares_prefill(policy)}
    pending: dict[str, dict[str, dict[str, Any]]] = {}  # uid -> key -> record

    def run_shared(batch: list[RulerItem], key: str) -> list[dict[str, Any]]:
        for it in batch:
            if key not in pending.get(it.uid, {}):
                want = {k: v for k, v in shared.items()
                        if k == key or it.uid not in store.examples(k)}
                pending[it.uid] = score_shared(model, tokenizer, it, want, chat)
        return [pending[it.uid].pop(key) for it in batch]

    for key, policy, fixed in jobs:
        def run(batch, key=key, policy=policy, fixed=fixed):
            if key in shared:
                return run_shared(batch, key)
            if query_aware:
                return [score_query_aware(model, tokenizer, it, policy, fixed) for it in batch]
            return [score_agnostic(model, tokenizer, it, policy, fixed, chat) for it in batch]

        run_resumable(store, key, items, run, ruler_summary, extra, 1, progress, policy)
    return [key for key, _, _ in jobs]
