"""The question-answering runner: every policy x budget x example of a benchmark, once for all.

A benchmark (RULER, LongBench, the needle, ...: :mod:`kvgate.eval.benchmarks`) builds its
examples as :class:`QAItem` (context tokens, question tokens, gold answers and their tokens,
tokens to generate, its own record fields) grouped in :class:`Cell` (one result key's task
part), and supplies a metric (:attr:`QABenchmark.score`: a generated answer's score in %).
:func:`run_qa` does the rest:

- question-agnostic (key mode ``modes[0]``): the policy compresses the context, then the
  question is asked over the compressed cache; every one-shot policy and budget of an example
  shares one prefill (``SharedPrefill``; RoCo's streamed prefill and the gate's eq. 5 run
  alone); query-aware (``modes[1]``): context and question are prefilled together;
- ``scores``: ``generate`` (greedy decoding, the metric scores the text) and / or ``teacher``
  (:mod:`kvgate.eval.teacher`: the gold answers fed once, mean log-likelihood and
  greedy-exact; several answers aggregated as the metric does: all must be found, or any);
- each key is resumable (:func:`kvgate.eval.resumable.run_resumable`); each record holds the
  answer, the score, the kept share, the seconds of compress + answer and the item's fields;
  the summary the mean score with its 95% interval, %Evict and seconds per example, and where
  both scorers ran the share of examples on which they agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.cache.shared_passes import share_group
from kvgate.eval.asked import Asked, Question, ask_agnostic, ask_query_aware, ask_shared
from kvgate.eval.intervals import mean_interval
from kvgate.eval.qa_options import check_scores
from kvgate.eval.resumable import Tally, add_records, evict_summary, planned_runs, run_resumable
from kvgate.eval.store import ResultStore, budget_label, make_key
from kvgate.eval.teacher import answer_tokens
from kvgate.policies.base import Budget, Policy

Record = dict[str, Any]


@dataclass(frozen=True)
class QAItem:
    """One example as asked: ``context`` tokens (compressed), then ``question``; ``match``:
    how several gold answers count, ``"all"`` (each must be found: the mean) or ``"any"``
    (the best); ``fields``: what the benchmark stores in its record (depth, length, ...);
    ``meta``: what its metric reads besides the answers (the task, ...)."""

    uid: str
    context: tuple[int, ...]
    question: Question
    answers: tuple[str, ...]
    match: str = "all"
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)  # for the metric

    @property
    def ids(self) -> tuple[int, ...]:
        """Every prompt token (what the stored digest and the batching size read)."""
        return self.context + self.question.ids


@dataclass
class Cell:
    """The items of one result key's task part (``niah_single_1@4096``), the fields stored
    beside its summary, and the summary."""

    task: str
    items: list[QAItem]
    extra: dict[str, Any] = field(default_factory=dict)
    summary: Callable[[Mapping[str, Record]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class QABenchmark:
    """What a question-answering benchmark gives the runner: its key kind, its metric (a
    generated answer -> record fields, ``score`` in % among them) and the key modes of the
    question-agnostic and the query-aware setting."""

    kind: str
    score: Callable[[QAItem, str], Record]
    modes: tuple[str, str] = ("agnostic", "query-aware")


def text_item(tokenizer: Any, uid: str, context: str, question: str, answer_prefix: str | None,
              answers: Sequence[str], max_new_tokens: int, chat: bool = True,
              match: str = "all", fields: Mapping[str, Any] | None = None,
              meta: Mapping[str, Any] | None = None) -> QAItem:
    """An item from text, tokenised exactly as ``Engine.compress`` / ``Engine.answer`` build
    the prompt (the chat template when the tokenizer has one and ``chat``: ``meta["chat"]``
    says whether it was used); its record holds ``n_ctx``, the context part's tokens."""
    from kvgate.inference.compress import has_chat_template, split_prompt

    chat = chat and has_chat_template(tokenizer)
    ctx, asked = split_prompt(tokenizer, context, question, answer_prefix, chat)
    ctx_ids = tuple(tokenizer(ctx, add_special_tokens=not chat)["input_ids"])
    q_ids = tuple(tokenizer(asked, add_special_tokens=False)["input_ids"])
    gold = tuple(answer_tokens(tokenizer, asked, a) for a in answers)
    asked_q = Question(q_ids, max_new_tokens, gold, tuple(answers))
    return QAItem(uid, ctx_ids, asked_q, tuple(answers), match,
                  {**(fields or {}), "n_ctx": len(ctx_ids)}, {**(meta or {}), "chat": chat})


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def record(bench: QABenchmark, item: QAItem, asked: Asked) -> Record:
    """An example's record: the asked fields, the item's, the metric's and the teacher's."""
    out = {**asked.record(), "answers": list(item.answers), **item.fields}
    if asked.text is not None:
        out.update(bench.score(item, asked.text))
    if asked.teacher:
        pick = max if item.match == "any" else _mean
        out["teacher"] = [t.record() for t in asked.teacher]
        out["teacher_score"] = 100.0 * pick([float(t.exact) for t in asked.teacher])
        out["teacher_ll"] = pick([t.ll for t in asked.teacher])
        out.setdefault("score", out["teacher_score"])
    return out


def qa_summary(records: Mapping[str, Record]) -> dict[str, Any]:
    """Mean score (%), its 95% interval, seconds per example and %Evict; with teacher scores
    their mean, interval and mean log-likelihood, and where answers were also generated the
    share of examples whose greedy-exact score equals the generated one (``agree_pct``)."""
    recs = list(records.values())
    n = len(recs)
    nan = float("nan")
    scores = [float(r["score"]) for r in recs]
    lo, hi = mean_interval(scores) if n else (nan, nan)
    out = {"n": n, "acc": _mean(scores) if n else nan, "ci_low": lo, "ci_high": hi,
           "sec_per_example": _mean([float(r["seconds"]) for r in recs]) if n else nan,
           **evict_summary(records)}
    taught = [r for r in recs if "teacher_score" in r]
    if taught:
        values = [float(r["teacher_score"]) for r in taught]
        t_lo, t_hi = mean_interval(values)
        out.update({"teacher_acc": _mean(values), "teacher_ci_low": t_lo,
                    "teacher_ci_high": t_hi,
                    "teacher_ll": _mean([float(r["teacher_ll"]) for r in taught])})
        both = [r for r in taught if "output" in r]
        if both:
            out["agree_pct"] = 100.0 * _mean([float(r["teacher_score"] == r["score"])
                                              for r in both])
    return out


def run_qa(model: nn.Module, tokenizer: Any, bench: QABenchmark, cells: Sequence[Cell],
           policies: Mapping[str, Policy], budgets: Sequence[Budget], store: ResultStore, *,
           query_aware: bool = False, scores: Sequence[str] = ("generate",),
           progress: bool = True, kv: KVQuant | None = None) -> list[str]:
    """Score every (cell, policy, budget); returns the result keys. ``progress``: one display
    of every (key, example) pair of the run (:class:`~kvgate.eval.resumable.Tally`)."""
    scores = check_scores(scores)
    keys = []
    pairs = sum(len(cell.items) for cell in cells) * planned_runs(policies, budgets)
    with Tally(pairs, bench.kind, progress) as tally:
        for cell in cells:
            keys += _run_cell(model, tokenizer, bench, cell, policies, budgets, store,
                              query_aware, scores, tally, kv)
    return keys


def _run_cell(model: nn.Module, tokenizer: Any, bench: QABenchmark, cell: Cell,
              policies: Mapping[str, Policy], budgets: Sequence[Budget], store: ResultStore,
              query_aware: bool, scores: list[str], tally: Tally,
              kv: KVQuant | None = None) -> list[str]:
    """Every (policy, budget) of one cell, each under its resumable key."""
    mode = bench.modes[1] if query_aware else bench.modes[0]
    extra = {**cell.extra, "query_aware": query_aware}
    summary = cell.summary or qa_summary
    jobs = [(make_key(bench.kind, cell.task, name, budget_label(bud), mode), policy,
             bud or Budget(ratio=1.0))
            for name, policy in policies.items()
            for bud in ([None] if policy.budget_free else budgets)]
    # question-agnostic one-shot policies share each example's prefill (SharedPrefill), and
    # PassScoring ones reading the same passes share the prefill and the passes
    # (SharedPasses): the first key of a group that needs an example scores it for every key
    # of the group still lacking it, and stores the others' records at once (a kill loses
    # only what the store had not written yet; their own turn skips them)
    group = {key: share_group(policy) for key, policy, _ in jobs}
    shared = {key: (policy, fixed) for key, policy, fixed in jobs
              if not query_aware and group[key] is not None}

    def run_shared(batch: list[QAItem], key: str) -> list[Record]:
        out = []
        for it in batch:
            want = {k: v for k, v in shared.items() if group[k] == group[key]
                    and (k == key or not store.has_example(k, it.uid))}
            asked = ask_shared(model, tokenizer, it.context, it.question, want, scores, kv)
            recs = {k: {**record(bench, it, a), "shared_prefill": len(want)}
                    for k, a in asked.items()}
            for k, rec in recs.items():
                if k != key:
                    add_records(store, k, [(it, rec)], summary, extra, shared[k][0], tally)
            out.append(recs[key])
        return out

    for key, policy, fixed in jobs:
        def run(batch: list[QAItem], key=key, policy=policy, fixed=fixed) -> list[Record]:
            if key in shared:
                return run_shared(batch, key)
            ask = ask_query_aware if query_aware else ask_agnostic
            return [record(bench, it, ask(model, tokenizer, it.context, it.question, policy,
                                          fixed, scores, kv)) for it in batch]

        run_resumable(store, key, cell.items, run, summary, extra, 1, tally, policy)
    return [key for key, _, _ in jobs]
