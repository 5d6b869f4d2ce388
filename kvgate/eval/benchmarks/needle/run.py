"""Passkey retrieval under eviction (needle in a haystack).

Passkey (needle in a haystack). A prompt of exactly ``length`` tokens::

    [BOS] intro | filler ... needle ... filler | question

The filler is corpus text (token ids of the passages in order, cycled if short); the needle
sentence carries a random 5-digit key and is inserted after ``depth`` % of the filler tokens,
moved to the nearest sentence end within a few tokens when there is one. Everything is built in
token space, so the length is exact and the depth is known to the token. By default the policy
compresses ``[intro | filler ... needle ...]`` and the question comes after, over the compressed
cache (key mode ``...-agnostic``); ``query_aware`` compresses the whole prompt, question included
(the old setting, whose keys lack the suffix: records from before read as query-aware). Two
scorers:

- ``generate`` (cache mode): greedy decoding over the compressed cache; a hit when the key
  appears in the first ``max_new_tokens`` generated tokens;
- ``rank`` (cheap, masked or cache mode): the key against ``distractors`` random keys by
  log-likelihood; a hit when the true key scores best.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.eval.asked import Question
from kvgate.eval.errors import EvalError, encode
from kvgate.eval.masked import ScoringItem
from kvgate.eval.multiple_choice import check_mode, mc_summary, run_items
from kvgate.eval.resumable import Tally, planned_runs
from kvgate.eval.runner import Cell, QABenchmark, QAItem, run_qa
from kvgate.eval.store import ResultStore, budget_label, make_key
from kvgate.eval.teacher import answer_tokens
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.models.load import pad_id
from kvgate.policies.base import Budget, Policy

INTRO = "A pass key is hidden in the text below. Find it and remember it."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
SNAP = 16  # tokens the needle may move to land on a sentence end


@dataclass(frozen=True)
class NeedleExample:
    """One passkey prompt. ``ids`` has exactly ``length`` tokens; the needle occupies
    ``ids[needle_start: needle_start + needle_len]``; ``actual_depth`` is the share (%) of
    filler tokens before it."""

    uid: str
    ids: tuple[int, ...]
    key: str
    length: int
    depth: float
    needle_start: int
    needle_len: int
    filler_len: int
    actual_depth: float


def filler_ids(tokenizer: Any, texts: Sequence[str], need: int) -> list[int]:
    """At least ``need`` filler token ids from ``texts`` in order (cycled when short)."""
    pieces = [encode(tokenizer, " " + " ".join(t.split())) for t in texts if t.strip()]
    pieces = [p for p in pieces if p]
    if not pieces:
        raise EvalError("the filler texts encode to no tokens")
    out: list[int] = []
    i = 0
    while len(out) < need:
        out.extend(pieces[i % len(pieces)])
        i += 1
    return out


def _sentence_end(tokenizer: Any, ids: Sequence[int], cut: int) -> int:
    """The insertion point nearest ``cut`` that follows a sentence end ('.', '!', '?',
    newline), searched within ``SNAP`` tokens; ``cut`` itself when there is none."""
    lo, hi = max(1, cut - SNAP), min(len(ids), cut + SNAP)
    best = None
    for i in range(lo, hi + 1):  # a few dozen decodes per prompt, not a hot path
        text = tokenizer.decode([ids[i - 1]])
        if text.rstrip(" ").endswith((".", "!", "?", "\n")) and \
                (best is None or abs(i - cut) < abs(best - cut)):
            best = i
    return cut if best is None or cut in (0, len(ids)) else best


def random_key(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def make_needle(tokenizer: Any, filler: Sequence[int], length: int, depth: float, key: str,
                uid: str, snap: bool = True) -> NeedleExample:
    """A passkey prompt of exactly ``length`` tokens with the needle at ``depth`` % of the
    filler (see the module docstring)."""
    if not 0.0 <= depth <= 100.0:
        raise EvalError(f"needle depth must lie in [0, 100] %, got {depth}")
    head = encode(tokenizer, INTRO, special=True)
    needle = encode(tokenizer, NEEDLE.format(key=key))
    question = encode(tokenizer, QUESTION)
    n_fill = length - len(head) - len(needle) - len(question)
    if n_fill < 1:
        raise EvalError(f"needle length {length} leaves no room for filler (intro, needle and "
                        f"question take {length - n_fill} tokens)")
    if len(filler) < n_fill:
        raise EvalError(f"need {n_fill} filler tokens, got {len(filler)}")
    hay = list(filler[:n_fill])
    cut = round(depth / 100.0 * n_fill)
    if snap:
        cut = _sentence_end(tokenizer, hay, cut)
    ids = head + hay[:cut] + needle + hay[cut:] + question
    return NeedleExample(uid, tuple(ids), key, length, depth, len(head) + cut, len(needle),
                         n_fill, 100.0 * cut / n_fill)


def needle_set(tokenizer: Any, texts: Sequence[str], length: int, depth: float, samples: int,
               seed: int = 0) -> list[NeedleExample]:
    """``samples`` prompts of one (length, depth) cell; each sample takes its filler from a
    different offset of the corpus and its own key (deterministic in ``seed``)."""
    rng = random.Random(f"{seed}|{length}|{depth}")
    stream = filler_ids(tokenizer, texts, length * (samples + 1))
    out = []
    for s in range(samples):
        start = rng.randrange(0, max(1, len(stream) - length))
        out.append(make_needle(tokenizer, stream[start:start + length], length, depth,
                               random_key(rng), f"needle:{length}:{depth:g}:{s}"))
    return out


def rank_item(example: NeedleExample, tokenizer: Any, distractors: int = 9,
              seed: int = 0, query_aware: bool = True) -> ScoringItem:
    """The prompt with the true key among ``distractors`` other keys, gold at a random place
    (so ties never favour the true key). Not ``query_aware``: the context stops before the
    question, and each choice is the question + its key (the question's tokens score the same
    under every choice, so the ranking is the keys')."""
    rng = random.Random(f"{seed}|{example.uid}")
    keys = {example.key}
    while len(keys) < distractors + 1:
        keys.add(random_key(rng))
    others = sorted(keys - {example.key})
    rng.shuffle(others)
    gold = rng.randrange(distractors + 1)
    order = others[:gold] + [example.key] + others[gold:]
    q = () if query_aware else tuple(encode(tokenizer, QUESTION))
    choices = tuple(q + tuple(encode(tokenizer, " " + k)) for k in order)
    context = example.ids if query_aware else example.ids[:len(example.ids) - len(q)]
    return ScoringItem(example.uid, context, choices, gold, tuple(len(k) for k in order))


def needle_score(item: QAItem, text: str) -> dict[str, Any]:
    """A hit when the key appears in the generated text."""
    hit = item.meta["key"] in text
    return {"score": 100.0 * hit, "hit": hit, "key": item.meta["key"]}


NEEDLE_QA = QABenchmark("needle", needle_score, ("generate-cache-agnostic", "generate-cache"))


def qa_items(tokenizer: Any, examples: Sequence[NeedleExample],
             max_new_tokens: int) -> list[QAItem]:
    """The prompts as the question-answering runner asks them: the question after
    ``[intro | filler ... needle ...]`` (or inside the compressed prompt, query-aware)."""
    question = tuple(encode(tokenizer, QUESTION))
    out = []
    for ex in examples:
        gold = (answer_tokens(tokenizer, QUESTION, ex.key),)
        out.append(QAItem(ex.uid, ex.ids[:len(ex.ids) - len(question)],
                          Question(question, max_new_tokens, gold, (ex.key,)), (ex.key,),
                          fields={"n_ctx": len(ex.ids)}, meta={"key": ex.key}))
    return out


def check_needle_fits(items: Sequence[ScoringItem | NeedleExample], limit: int | None,
                      max_new_tokens: int) -> None:
    """``InputTooLongError`` if a needle prompt and its answer (a ranked key, or the tokens to
    generate) overrun the model's ``limit`` positions."""
    if limit is None:
        return
    for it in items:
        if isinstance(it, ScoringItem):
            prompt, extra, what = len(it.context), max(map(len, it.choices)), "answer"
        else:
            prompt, extra, what = len(it.ids), max_new_tokens, "new"
        if prompt + extra > limit:
            raise InputTooLongError(
                f"needle prompt {it.uid} has {prompt:,} tokens + {extra} {what} tokens; the "
                f"model takes at most {limit:,} (max_position_embeddings): use --lengths of at "
                f"most {limit - extra:,}")


def needle_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The ranking's accuracy and %Evict."""
    summary = mc_summary(records)
    summary.pop("acc_norm", None)
    return summary


def evaluate_needle(model: nn.Module, tokenizer: Any, texts: Sequence[str],
                    lengths: Sequence[int], depths: Sequence[float],
                    policies: Mapping[str, Policy], budgets: Sequence[Budget],
                    store: ResultStore, *, scoring: str = "rank", mode: str = "masked",
                    samples: int = 5, distractors: int = 9, max_new_tokens: int = 8,
                    batch_size: int = 1, seed: int = 0, progress: bool = True,
                    query_aware: bool = False, scores: Sequence[str] = ("generate",),
                    kv: KVQuant | None = None) -> list[str]:
    """Accuracy per (length, depth, policy, budget); returns the result keys. The question
    comes after compression unless ``query_aware`` (see the module docstring).

    scoring ``rank`` runs in ``mode`` (masked or cache); ``generate`` always runs over the
    compressed cache. Every prompt, with its answer (rank) or ``max_new_tokens`` (generate),
    must fit the model's context: a length that does not is refused before anything is scored
    (a needle prompt is never cut: its length is what is measured). ``kv``: how the caches
    store kept entries (generate, or rank in cache mode; None: as the model gives them).
    """
    if scoring not in ("rank", "generate"):
        raise EvalError(f"needle scoring must be 'rank' or 'generate', got {scoring!r}")
    mode = "cache" if scoring == "generate" else check_mode(mode)
    cells = []
    for length in lengths:
        for depth in depths:
            examples = needle_set(tokenizer, texts, int(length), float(depth), samples, seed)
            whole = [rank_item(ex, tokenizer, distractors, seed) for ex in examples]
            ranked = whole if query_aware else [rank_item(ex, tokenizer, distractors, seed, False)
                                                for ex in examples]
            # the same tokens either way; checked (and named) as whole prompts
            check_needle_fits(whole if scoring == "rank" else examples,
                              context_limit(model.config), max_new_tokens)
            extra = {"length": int(length), "depth": float(depth),
                     "actual_depth": sum(ex.actual_depth for ex in examples) / len(examples)}
            cells.append((f"{length}@{depth:g}", extra, examples, ranked))
    if scoring == "generate":
        qa = [Cell(task, qa_items(tokenizer, examples, max_new_tokens), extra)
              for task, extra, examples, _ in cells]
        return run_qa(model, tokenizer, NEEDLE_QA, qa, policies, budgets, store,
                      query_aware=query_aware, scores=scores, progress=progress, kv=kv)
    pad = pad_id(tokenizer)
    keys = []
    pairs = sum(len(ranked) for *_, ranked in cells) * planned_runs(policies, budgets)
    with Tally(pairs, "needle", progress) as tally:
        for task, extra, _, ranked in cells:
            for name, policy in policies.items():
                buds: Sequence[Budget | None] = [None] if policy.budget_free else budgets
                for bud in buds:
                    fixed = bud or Budget(ratio=1.0)
                    key = make_key("needle", task, name, budget_label(bud),
                                   f"rank-{mode}" + ("" if query_aware else "-agnostic"))
                    run_items(model, ranked, policy, lambda _u, b=fixed: b,
                              mode, store, key, needle_summary, extra, batch_size, pad, tally,
                              tokenizer=tokenizer, kv=kv)
                    keys.append(key)
    return keys
