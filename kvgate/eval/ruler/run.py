"""``kvgate eval ruler``: RULER-style tasks under eviction, question-agnostic by default.

Each (task, length) gets ``limit`` examples (:func:`kvgate.eval.ruler.tasks.generate`, seeds
0..limit-1; a needle family's example ``s`` sits at ``depths[s % len(depths)]``, the other
families draw their own depths). Per policy and budget, every example is scored one at a time:

- question-agnostic (the default, key mode ``agnostic``): the context is compressed with
  ``Engine.compress`` (the policy never sees the question), then ``Engine.answer`` asks the
  question (with the task's answer prefix) over the compressed cache and decodes greedily;
- query-aware (``--query-aware``, key mode ``query-aware``): the same tokens, context and
  question, are prefilled together under the policy (which then sees the question), then
  decoded greedily (:mod:`kvgate.eval.runner` runs both, and ``--score teacher``).

The answer is scored with RULER's metric of the task (``string_match_all`` /
``string_match_part``, in %); each example's record holds the answer text, the score, the kept
share and the seconds of compress + answer. Keys: ``ruler|TASK@LENGTH|POLICY|BUDGET|MODE``.
Every prompt (context, question, answer prefix and the tokens to generate) must fit the model's
context: a length that does not is refused before anything is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from kvgate.eval.report import ResultStore
from kvgate.eval.ruler.scoring import score
from kvgate.eval.ruler.tasks import NIAH, SCORING, TASKS, RulerExample, generate
from kvgate.eval.runner import Cell, QABenchmark, QAItem, run_qa, text_item
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.policies.base import Budget, Policy

# RULER's tokens_to_generate per family (scripts/synthetic.yaml); --max-new-tokens caps them
MAX_NEW_TOKENS = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32,
                  "qa_2": 32}
NEEDLE_FAMILIES = tuple(NIAH)
MODES = ("agnostic", "query-aware")


def task_max_new_tokens(task: str, cap: int | None = None) -> int:
    n = MAX_NEW_TOKENS[task]
    return n if cap is None else min(n, cap)


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
                model_limit: int | None = None, source: str = "generated") -> list[QAItem]:
    """The ``limit`` examples of (task, length); ``InputTooLongError`` when a prompt and its
    answer tokens overrun ``model_limit``."""
    items = []
    match = "any" if SCORING[task] == "string_match_part" else "all"
    for suffix, ex, depth, own_new in _examples(task, tokenizer, length, depths, limit, seed,
                                                source):
        new = task_max_new_tokens(task, max_new_cap) if own_new is None else (
            own_new if max_new_cap is None else min(own_new, max_new_cap))
        item = text_item(tokenizer, f"{task}@{length}:{suffix}", ex.context, ex.question,
                         ex.answer_prefix, ex.answers, new, chat, match, {"depth": depth},
                         {"task": ex.task})
        total = len(item.ids) + new
        if model_limit is not None and total > model_limit:
            raise InputTooLongError(
                f"ruler {task} at length {length:,}: the prompt has {len(item.ids):,}"
                f" tokens + {new} new tokens = {total:,}; the model takes at most "
                f"{model_limit:,} (max_position_embeddings): use --lengths of at most "
                f"{max(0, length - (total - model_limit)):,}")
        items.append(item)
    return items


def ruler_score(item: QAItem, text: str) -> dict[str, Any]:
    """RULER's metric of the item's task, in %."""
    return {"score": score(item.meta["task"], [text], [list(item.answers)])}


RULER = QABenchmark("ruler", ruler_score, MODES)


def evaluate_ruler(model: nn.Module, tokenizer: Any, tasks: Sequence[str],
                   lengths: Sequence[int], policies: Mapping[str, Policy],
                   budgets: Sequence[Budget], store: ResultStore, *,
                   depths: Sequence[float] = (0, 25, 50, 75, 100), limit: int = 5,
                   query_aware: bool = False, chat: bool = True, seed: int = 0,
                   max_new_tokens: int | None = None, progress: bool = True,
                   source: str = "generated", scores: Sequence[str] = ("generate",)) -> list[str]:
    """Score every (task, length, policy, budget); returns the result keys. Every cell is
    built (and checked to fit the model) before anything is scored."""
    for task in tasks:
        if task not in TASKS:
            from kvgate.eval.ruler.haystack import RulerError

            raise RulerError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if getattr(tokenizer, "pad_token", "") is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_limit = context_limit(model.config)
    cells = [Cell(f"{task}@{length}", build_items(tokenizer, task, int(length), depths, limit,
                                                  seed, chat, max_new_tokens, model_limit,
                                                  source),
                  {"family": task, "length": int(length)})
             for length in lengths for task in tasks]
    return run_qa(model, tokenizer, RULER, cells, policies, budgets, store,
                  query_aware=query_aware, scores=scores, progress=progress)
