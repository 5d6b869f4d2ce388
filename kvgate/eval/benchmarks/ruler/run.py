"""``kvgate eval ruler``: RULER-style tasks under eviction, question-agnostic by default.

Each (task, length) gets ``limit`` examples
(:func:`kvgate.eval.benchmarks.ruler.tasks.generate`, seeds 0..limit-1; a needle family's
example ``s`` sits at ``depths[s % len(depths)]``, the other families draw their own depths).
Per policy and budget, every example is scored one at a time:

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
context: a length that does not is refused before anything is scored, in one line giving the
longest length at which every task asked fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.eval.benchmarks.ruler.scoring import score
from kvgate.eval.benchmarks.ruler.tasks import NIAH, SCORING, TASKS, RulerExample, generate
from kvgate.eval.runner import Cell, QABenchmark, QAItem, run_qa, text_item
from kvgate.eval.store import ResultStore
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.policies.base import Budget, Policy

# RULER's tokens_to_generate per family (scripts/synthetic.yaml); --max-new-tokens caps them
MAX_NEW_TOKENS = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32,
                  "qa_2": 32}
NEEDLE_FAMILIES = tuple(NIAH)
MODES = ("agnostic", "query-aware")
MIN_LENGTH = 16  # the shortest --lengths (RulerConfig)


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
                source: str = "generated") -> list[QAItem]:
    """The ``limit`` examples of (task, length) (:func:`check_fit` checks them against the
    model)."""
    items = []
    match = "any" if SCORING[task] == "string_match_part" else "all"
    for suffix, ex, depth, own_new in _examples(task, tokenizer, length, depths, limit, seed,
                                                source):
        new = task_max_new_tokens(task, max_new_cap) if own_new is None else (
            own_new if max_new_cap is None else min(own_new, max_new_cap))
        items.append(text_item(tokenizer, f"{task}@{length}:{suffix}", ex.context, ex.question,
                               ex.answer_prefix, ex.answers, new, chat, match,
                               {"depth": depth}, {"task": ex.task}))
    return items


def _need(item: QAItem) -> int:
    """Positions an item takes: its prompt and the tokens it may generate."""
    return len(item.ids) + item.question.max_new_tokens


def check_fit(cells: Mapping[tuple[str, int], list[QAItem]], model_limit: int,
              rebuild: Callable[[str, int], list[QAItem]] | None = None) -> None:
    """``InputTooLongError`` when an item of ``cells`` ((task, length) -> items) overruns
    ``model_limit``, naming the worst and the longest length at which every task fits.

    Each task's question, answer prefix and tokens to generate take their own room, and it
    differs by a few tokens between examples and lengths (other needles, other filler), so
    the length is found, not guessed from one task: from the largest room any item needs,
    then checked on the examples ``rebuild(task, length)`` makes there, lower while a task
    overruns, higher while every one has room to spare; the longest length seen to fit is
    given. Without ``rebuild`` (a dataset whose lengths are its own) the first estimate is."""
    over = [(_need(it), task, length, it) for (task, length), items in cells.items()
            for it in items if _need(it) > model_limit]
    if not over:
        return
    need, task, length, item = max(over, key=lambda o: (o[0] - o[2], o[2]))
    tasks = sorted({t for t, _ in cells})
    fits = model_limit - max(_need(it) - n for (_, n), items in cells.items() for it in items)
    tried: dict[int, int] = {}  # length -> the most positions any task's example needs there
    while rebuild is not None and MIN_LENGTH <= fits and fits not in tried and len(tried) < 16:
        tried[fits] = max(_need(it) for t in tasks for it in rebuild(t, fits))
        if tried[fits] > model_limit:
            fits -= tried[fits] - model_limit
        elif tried[fits] < model_limit:  # room to spare here: a longer one may fit too
            fits += max(1, (model_limit - tried[fits]) // 2)
    if rebuild is not None:  # the longest length seen to fit, if any
        fits = max((n for n, most in tried.items() if most <= model_limit), default=0)
    advice = (f"use --lengths of at most {fits:,} (every task asked fits there)"
              if fits >= MIN_LENGTH else "no --lengths fits: its question and answer alone "
              f"take {need - length:,} of them")
    raise InputTooLongError(
        f"ruler {task} at length {length:,}: the prompt has {len(item.ids):,} tokens + "
        f"{item.question.max_new_tokens} new tokens = {need:,}; the model takes at most "
        f"{model_limit:,} (max_position_embeddings): {advice}")


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
                   source: str = "generated", scores: Sequence[str] = ("generate",),
                   kv: KVQuant | None = None) -> list[str]:
    """Score every (task, length, policy, budget); returns the result keys. Every cell is
    built (and checked to fit the model) before anything is scored. ``kv``: how the caches
    store kept entries (None: as the model gives them)."""
    for task in tasks:
        if task not in TASKS:
            from kvgate.eval.benchmarks.ruler.haystack import RulerError

            raise RulerError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if getattr(tokenizer, "pad_token", "") is None:
        tokenizer.pad_token = tokenizer.eos_token
    def items_of(task: str, length: int) -> list[QAItem]:
        return build_items(tokenizer, task, length, depths, limit, seed, chat, max_new_tokens,
                           source)

    built = {(task, int(length)): items_of(task, int(length))
             for length in lengths for task in tasks}
    check_fit(built, context_limit(model.config),
              items_of if source == "generated" else None)
    cells = [Cell(f"{task}@{length}", items, {"family": task, "length": length})
             for (task, length), items in built.items()]
    return run_qa(model, tokenizer, RULER, cells, policies, budgets, store,
                  query_aware=query_aware, scores=scores, progress=progress, kv=kv)
