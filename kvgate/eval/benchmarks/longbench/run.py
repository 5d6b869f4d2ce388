"""``kvgate eval longbench``: LongBench (Bai et al., "LongBench: A Bilingual, Multitask Benchmark
for Long Context Understanding", arXiv:2308.14508) under eviction, question-agnostic by default.

The examples are :func:`kvgate.data.longctx.load_longbench`'s: kvpress's hub copy
(``Xnhyacinth/LongBench``, whose contexts hold each task's instruction), or a ``save_to_disk``
folder of it or of THUDM's layout. Per task, policy and budget every example is scored one at a
time, as ``kvgate eval ruler`` scores RULER:

- question-agnostic (the default, key mode ``agnostic``): ``Engine.compress`` compresses the
  context (the policy never sees the question), then ``Engine.answer`` asks the question with
  the answer prefix over the compressed cache and decodes greedily;
- query-aware (``query_aware``, key mode ``query-aware``): the same tokens, context and
  question, are prefilled together under the policy, then decoded greedily.

Prompts: the chat template when the tokenizer has one and ``chat`` is on, except on the tasks
LongBench prompts plainly (the few-shot trec, triviaqa, samsum, lsht and the code tasks lcc,
repobench-p: :data:`PLAIN_TASKS`). An example without a question (kvpress's vcsum, THUDM's
summarisation rows) asks its answer prefix (or "Answer:") in the question's place.
Tokens to generate: LongBench's per-task maximum (:data:`MAX_NEW_TOKENS`, 32 to 512), capped
by ``max_new_tokens``.

Length: ``max_length`` cuts a context of more tokens in the middle, keeping its first
``max_length // 2`` tokens and its last ``max_length - max_length // 2``, each decoded and the
two joined, as LongBench does (LongBench cuts its whole prompt; here the context, the part
that is compressed). A prompt (context, question and tokens to generate) longer than the
model's context is refused before anything is scored, naming a ``--max-length`` that fits.

Scores: the task's LongBench metric, best over the references, in %
(:mod:`kvgate.eval.benchmarks.longbench.scoring`); each record holds the answer, the score, the kept
share, the seconds of compress + answer and the context tokens cut. Keys:
``longbench|TASK|POLICY|BUDGET|MODE``; a key's summary: the mean score, its 95% interval,
seconds per example, %Evict and, for LongBench-E tasks, the mean per length bucket (0-4k, 4-8k,
8k+ in the dataset's ``length``, as LongBench-E reports).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.data.longctx import LongExample, load_longbench
from kvgate.eval.benchmarks.longbench.scoring import TASK_METRIC, base_task, score_example
from kvgate.eval.runner import Cell, QABenchmark, QAItem, qa_summary, run_qa, text_item
from kvgate.eval.store import ResultStore
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.policies.base import Budget, Policy

# LongBench's tokens to generate per task (its config dataset2maxlen)
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512,
    "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}
# the tasks LongBench prompts without the chat template (few-shot and code completion)
PLAIN_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
MODES = ("agnostic", "query-aware")
LENGTH_BUCKETS = (("0-4k", 0, 4000), ("4-8k", 4000, 8000), ("8k+", 8000, math.inf))
FALLBACK_QUESTION = "Answer:"


def task_max_new_tokens(task: str, cap: int | None = None) -> int:
    n = MAX_NEW_TOKENS[base_task(task)]
    return n if cap is None else min(n, cap)


def middle_truncate(tokenizer: Any, text: str, max_length: int | None) -> tuple[str, int]:
    """``text`` cut to ``max_length`` tokens in the middle (the first half and the last half,
    each decoded, joined) and the number of tokens dropped; as it is when it fits."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_length is None or len(ids) <= max_length:
        return text, 0
    head = max_length // 2
    tail = max_length - head
    kept = (tokenizer.decode(ids[:head], skip_special_tokens=True)
            + tokenizer.decode(ids[len(ids) - tail:], skip_special_tokens=True))
    return kept, len(ids) - max_length


def as_asked(example: LongExample, context: str) -> LongExample:
    """``example`` with ``context`` and a question that is never empty (the answer prefix, or
    "Answer:", takes an empty question's place)."""
    if example.question.strip():
        return dataclasses.replace(example, context=context)
    prefix = example.answer_prefix or ""
    question = prefix if prefix.strip() else FALLBACK_QUESTION
    return dataclasses.replace(example, context=context, question=question, answer_prefix="")


def load_examples(tasks: Sequence[str], source: str = "hub",
                  limit: int | None = None) -> dict[str, list[LongExample]]:
    """The first ``limit`` examples of each task (all without a limit)."""
    return {task: load_longbench(task, source=source, limit=limit) for task in tasks}


def _too_long(task: str, uid: str, n_prompt: int, new: int, n_text: int, limit: int) -> str:
    total = n_prompt + new
    fit = n_text - (total - limit)
    hint = (f"pass --max-length {fit} or less to cut contexts in the middle" if fit >= 2 else
            "its question and answer tokens alone leave no room for a context")
    return (f"longbench {task} example {uid}: the prompt has {n_prompt:,} tokens + {new} new "
            f"tokens = {total:,}; the model takes at most {limit:,} (max_position_embeddings): "
            f"{hint}")


def build_items(tokenizer: Any, task: str, examples: Sequence[LongExample], *,
                chat: bool = True, max_length: int | None = None,
                max_new_cap: int | None = None,
                model_limit: int | None = None) -> list[QAItem]:
    """The items of one task; ``InputTooLongError`` when a prompt and its answer tokens
    overrun ``model_limit``."""
    chat = chat and base_task(task) not in PLAIN_TASKS
    new = task_max_new_tokens(task, max_new_cap)
    seen: Counter[str] = Counter()
    items = []
    for ex in examples:
        uid = ex.id if not seen[ex.id] else f"{ex.id}#{seen[ex.id]}"
        seen[ex.id] += 1
        context, dropped = middle_truncate(tokenizer, ex.context, max_length)
        asked = as_asked(ex, context)
        item = text_item(tokenizer, uid, asked.context, asked.question,
                         asked.answer_prefix or None, asked.answers, new, chat, "any",
                         {"length": ex.length, "dropped": dropped},
                         {"task": ex.task, "all_classes": ex.all_classes})
        if model_limit is not None and len(item.ids) + new > model_limit:
            n_text = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            raise InputTooLongError(_too_long(task, uid, len(item.ids), new, n_text,
                                              model_limit))
        items.append(item)
    return items


def longbench_summary(records: Mapping[str, Mapping[str, Any]],
                      buckets: bool = False) -> dict[str, Any]:
    """The runner's summary (:func:`kvgate.eval.runner.qa_summary`); with ``buckets`` the
    mean score per LongBench-E length bucket (``acc_0-4k``, ...; NaN when empty)."""
    out = qa_summary(records)
    if buckets:
        for name, low, high in LENGTH_BUCKETS:
            got = [float(r["score"]) for r in records.values()
                   if r.get("length") is not None and low <= r["length"] < high]
            out[f"acc_{name}"] = sum(got) / len(got) if got else math.nan
    return out


def longbench_score(item: QAItem, text: str) -> dict[str, Any]:
    """The task's LongBench metric, best over the references, in %."""
    return {"score": score_example(item.meta["task"], text, list(item.answers),
                                   item.meta["all_classes"])}


LONGBENCH = QABenchmark("longbench", longbench_score, MODES)


def evaluate_longbench(model: nn.Module, tokenizer: Any,
                       tasks: Sequence[str] | Mapping[str, Sequence[LongExample]],
                       policies: Mapping[str, Policy], budgets: Sequence[Budget],
                       store: ResultStore, *, limit: int | None = None, source: str = "hub",
                       max_length: int | None = None, query_aware: bool = False,
                       chat: bool = True, max_new_tokens: int | None = None,
                       progress: bool = True, scores: Sequence[str] = ("generate",),
                       kv: KVQuant | None = None) -> list[str]:
    """Score every (task, policy, budget); returns the result keys. ``tasks``: names (read
    from ``source``, the first ``limit`` of each) or their examples already read. Every task's
    items are built (and checked to fit the model) before anything is scored. ``kv``: how the
    caches store kept entries (None: as the model gives them)."""
    for task in tasks:
        base_task(task)  # an unknown name: one line, before any data is read
    data = dict(tasks) if isinstance(tasks, Mapping) else load_examples(tasks, source, limit)
    if getattr(tokenizer, "pad_token", "") is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_limit = context_limit(model.config)
    cells = [Cell(task, build_items(tokenizer, task, examples, chat=chat, max_length=max_length,
                                    max_new_cap=max_new_tokens, model_limit=model_limit),
                  {"metric": TASK_METRIC[base_task(task)]},
                  partial(longbench_summary, buckets=task.endswith("-e")))
             for task, examples in data.items()]
    return run_qa(model, tokenizer, LONGBENCH, cells, policies, budgets, store,
                  query_aware=query_aware, scores=scores, progress=progress, kv=kv)
