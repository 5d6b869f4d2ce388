"""Multiple choice under KV eviction, in masked mode or over a compressed cache.

Prompts are zero-shot unless demonstrations were put before them (``kvgate.data.fewshot``).

Scoring (lm-evaluation-harness style): each choice's score is the sum of its tokens'
log-probabilities after the context; ``acc`` takes the best sum, ``acc_norm`` the best sum
divided by the choice's length in characters. The same continuation scorer serves the needle
ranking and perplexity under eviction (``kvgate.eval.benchmarks.needle.run``).

Modes:
- ``masked`` (the paper's way, ``kvgate.eval.masked``): one forward per example, the keep
  decisions applied as attention masks;
- ``cache``: the context is prefilled into a ``CompressedCache`` (only kept entries are stored)
  and every choice is a continuation over it. The cache serves one batch, so each choice gets
  its own row with the context repeated (the policy sees identical rows and keeps the same).
  Only here does ``kv`` (:class:`kvgate.cache.quant.KVQuant`: kept entries in 8 or 4 bits)
  apply; the masked mode stores nothing, and refuses it.

%Evict (the Attention-Gate paper's definition): ``100 x mean over examples of evicted / (L x H_kv x n_ctx)``, counted over
every (layer, KV head, real context token); the token-weighted mean is reported next to it.

Matched budgets: the reference policy (the learned gate) runs first; every heuristic then
gets, per example, ``Budget(ratio = 1 - the reference's eviction on that example)``, its count
per head rounded up (default; the heuristics then evict a little less than the reference) or
to the nearest token (``rounding="nearest"``, budget label ``matched~...``: the same eviction on
average).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.attention.masks import left_pad, right_pad
from kvgate.cache.quant import KVQuant
from kvgate.data.tasks import MCExample
from kvgate.eval.errors import EvalError, encode, model_device, model_shape
from kvgate.eval.masked import ItemScore, ScoringItem, check_budget_ratio, masked_scores
from kvgate.eval.resumable import Tally, evict_summary, planned_runs, run_resumable
from kvgate.eval.store import ResultStore, budget_label, make_key
from kvgate.inference import Engine
from kvgate.inference.compress import run_passes
from kvgate.inference.decode import left_padded_positions
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.models.load import pad_id
from kvgate.policies.base import Budget, Policy

MODES = ("masked", "cache")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise EvalError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


# ---------------------------------------------------------------------------------------------
# tokenisation


def mc_item(example: MCExample, tokenizer: Any, max_length: int | None = None) -> ScoringItem:
    """Tokenise one example the harness' way: a choice's tokens are those of
    ``context + choice`` after the context's own tokens (so merges at the seam are honoured);
    if the context's tokens are not a prefix of the joined text's, the choice is encoded alone.
    ``max_length`` cuts the context from the left so the longest choice still fits."""
    ctx = encode(tokenizer, example.context, special=True)
    if not ctx:
        raise EvalError(f"{example.uid}: the context encodes to no tokens and the tokenizer "
                        "adds no BOS to predict the first choice token from")
    choices = []
    for choice in example.choices:
        whole = encode(tokenizer, example.context + choice, special=True)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else []
        choices.append(tuple(cont or encode(tokenizer, choice)))
    if max_length is not None:
        room = max_length - max(len(c) for c in choices)
        if room < 1:
            raise EvalError(f"{example.uid}: a choice alone is longer than max_length={max_length}")
        ctx = ctx[-room:]
    return ScoringItem(example.uid, tuple(ctx), tuple(choices), example.gold,
                       tuple(len(c) for c in example.choices))


# ---------------------------------------------------------------------------------------------
# cache mode


@dataclass
class ContinuationScores:
    """Per (context, continuation) row: the continuation's summed log-probability, whether
    greedy decoding gives it, the context entries the cache kept (all layers and KV heads),
    the real context tokens and the continuation's tokens; each ``[N]``, on the CPU."""

    loglik: Tensor  # float64
    greedy: Tensor  # bool
    kept: Tensor  # long
    n_real: Tensor  # long
    tokens: Tensor  # long
    # entries held after the continuation (context and continuation, all layers and KV
    # heads): what a policy that also evicts while decoding holds by the end
    held_end: Tensor  # long


@torch.no_grad()
def score_continuations(model: nn.Module, cache: Any, contexts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]], pad: int = 0,
                        tokenizer: Any = None, step: int | None = None) -> ContinuationScores:
    """Prefill the left-padded ``contexts`` into ``cache`` (a fresh ``CompressedCache``: its
    policy compresses them), then feed each right-padded continuation over what was kept, in
    one forward, or ``step`` tokens per forward: the cache runs its eviction round after each,
    so a decode-evicting policy holds its capacity over the continuation as it would while
    generating (``step`` 1 is decoding). Every sequence non-empty. ``tokenizer``: for a
    ``PassScoring`` policy (KVzip), whose extra passes follow the prefill (without it such a
    cache refuses)."""
    num_layers, _ = model_shape(model)
    device = model_device(model)
    ctx_ids, ctx_mask = left_pad(contexts, pad)
    cont_ids, cont_mask = right_pad(continuations, pad)
    n_real = ctx_mask.sum(-1)
    ctx_pos = left_padded_positions(ctx_mask)
    cont_pos = n_real[:, None] + torch.arange(cont_ids.shape[1])
    # the prefill keeps only the last logits: the first continuation token's prediction
    first = model(input_ids=ctx_ids.to(device), attention_mask=ctx_mask.to(device),
                  position_ids=ctx_pos.to(device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1).logits[:, -1:]
    run_passes(model, tokenizer, cache, ctx_ids.to(device), ctx_mask.to(device))
    kept = _held_entries(cache, num_layers)
    mask = torch.cat([ctx_mask, cont_mask], dim=1).to(device)
    width = cont_ids.shape[1]
    step = step or width
    # one forward per block: the eviction rounds come between them (sequential by nature)
    rest = torch.cat([
        model(input_ids=cont_ids[:, s:s + step].to(device),
              attention_mask=mask[:, :ctx_mask.shape[1] + min(s + step, width)],
              position_ids=cont_pos[:, s:s + step].to(device), past_key_values=cache,
              use_cache=True).logits
        for s in range(0, width, step)], dim=1)
    logits = torch.cat([first, rest[:, :-1]], dim=1).float()  # [N, R, V]: predicts token r
    tok, real = cont_ids.to(device), cont_mask.to(device).bool()
    logp = logits.gather(-1, tok[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
    loglik = (logp.double() * real).sum(-1).cpu()
    greedy = ((logits.argmax(-1) == tok) | ~real).all(-1).cpu()
    return ContinuationScores(loglik, greedy, kept, n_real, cont_mask.sum(-1),
                              _held_entries(cache, num_layers))


def _held_entries(cache: Any, num_layers: int) -> Tensor:
    """[N] entries the cache holds per row, over all layers and KV heads, on the CPU."""
    return sum(cache.kept_counts(layer).sum(-1) for layer in range(num_layers)).cpu()


def cache_scores(model: nn.Module, items: Sequence[ScoringItem], policy: Policy,
                 budget: Budget, pad: int = 0, tokenizer: Any = None,
                 step: int | None = None, kv: KVQuant | None = None) -> list[ItemScore]:
    """Score items over a real compressed cache: prefill every (item, choice) row's context
    with ``policy`` at ``budget``, then feed the choice as a continuation (``step`` tokens
    per forward: ``score_continuations``). ``kv``: how the cache stores kept entries (None:
    as the model gives them)."""
    num_layers, kv_heads = model_shape(model)
    owner = [i for i, it in enumerate(items) for _ in it.choices]
    cache = Engine(model, None, policy, budget, **(kv or KVQuant()).kwargs()).new_cache()
    rows = score_continuations(model, cache, [items[i].context for i in owner],
                               [ch for it in items for ch in it.choices], pad, tokenizer, step)
    scores: dict[int, ItemScore] = {}
    for row, i in enumerate(owner):
        it = items[i]
        if i not in scores:
            n = int(rows.n_real[row])
            scores[i] = ItemScore(it.uid, [], [], n, int(rows.kept[row]),
                                  num_layers * kv_heads * n, held_end=[])
        scores[i].loglik.append(float(rows.loglik[row]))
        scores[i].tokens.append(int(rows.tokens[row]))
        scores[i].held_end.append(int(rows.held_end[row]))
    return [scores[i] for i in range(len(items))]


def score_batch(model: nn.Module, items: Sequence[ScoringItem], policy: Policy,
                budgets: Sequence[Budget], mode: str, pad: int = 0,
                tokenizer: Any = None, step: int | None = None,
                kv: KVQuant | None = None) -> list[ItemScore]:
    """Score a batch in ``mode``; ``budgets`` has one budget per item (``tokenizer``: for a
    ``PassScoring`` policy's extra passes in a cache; ``step``: continuation tokens per
    forward in a cache; ``kv``: how a cache stores kept entries)."""
    if check_mode(mode) == "masked":
        if kv is not None and kv.quantized:  # masks store nothing: the bits would be ignored
            raise EvalError(f"kv_bits {kv.bits} stores a real cache's entries; the masked "
                            "mode has none: use mode 'cache'")
        return masked_scores(model, items, policy, budgets, pad)[0]
    out: list[ItemScore | None] = [None] * len(items)
    groups: dict[Budget, list[int]] = {}
    for i, bud in enumerate(budgets):
        groups.setdefault(bud, []).append(i)
    for bud, idx in groups.items():  # a compressed cache holds one budget
        for i, s in zip(idx, cache_scores(model, [items[i] for i in idx], policy, bud, pad,
                                          tokenizer, step, kv)):
            out[i] = s
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# resumable runs


def best_choice(scores: Sequence[float]) -> int:
    """Index of the highest-scoring choice (the first on a tie)."""
    return max(range(len(scores)), key=scores.__getitem__)


def is_correct(record: Mapping[str, Any], metric: str = "acc") -> bool:
    """Whether a stored example's gold choice wins: by log-likelihood sum (``acc``) or by
    log-likelihood per character of the choice (``acc_norm``)."""
    scores = record["ll"]
    if metric == "acc_norm":
        scores = [x / max(c, 1) for x, c in zip(scores, record["chars"])]
    return best_choice(scores) == record["gold"]


def mc_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """acc / acc_norm (in %) and %Evict over the stored examples."""
    n = len(records)
    hits = hits_norm = 0
    for r in records.values():
        hits += int(is_correct(r))
        hits_norm += int(is_correct(r, "acc_norm"))
    acc = 100.0 * hits / n if n else math.nan
    acc_norm = 100.0 * hits_norm / n if n else math.nan
    return {"n": n, "acc": acc, "acc_norm": acc_norm, **evict_summary(records)}


def score_record(item: ScoringItem, score: ItemScore, budget: Budget | None) -> dict[str, Any]:
    record = {"ll": score.loglik, "tokens": score.tokens, "gold": item.gold,
              "chars": list(item.choice_chars or score.tokens), "n_ctx": score.n_ctx,
              "kept": score.kept, "total": score.total, "evict": score.evict,
              "budget": None if budget is None else (budget.ratio if budget.ratio is not None
                                                     else budget.tokens)}
    if score.held_end is not None:  # cache mode: what the cache holds after each choice
        per_token = score.total / max(score.n_ctx, 1)  # layers x KV heads
        record["held_end"] = score.held_end
        record["held_end_share"] = [h / max(per_token * (score.n_ctx + t), 1)
                                    for h, t in zip(score.held_end, score.tokens)]
    return record


def run_items(model: nn.Module, items: Sequence[ScoringItem], policy: Policy,
              budget_of: Callable[[str], Budget], mode: str, store: ResultStore, key: str,
              summarise: Callable[[Mapping[str, Any]], dict[str, Any]],
              extra: Mapping[str, Any] | None = None, batch_size: int = 8, pad: int = 0,
              progress: bool | Tally = True, record_budget: bool = True,
              tokenizer: Any = None, step: int | None = None,
              kv: KVQuant | None = None) -> dict[str, Any]:
    """Continuation scoring of ``items`` under one key (resumable); ``budget_of(uid)`` gives
    each item's budget; ``progress``: the run's ``Tally`` (or whether to show this key's
    own); ``kv``: how a cache-mode run's caches store kept entries. Returns the stored
    record."""
    check_mode(mode)

    def score(batch: list[ScoringItem]) -> list[dict[str, Any]]:
        budgets = [budget_of(it.uid) for it in batch]
        scores = score_batch(model, batch, policy, budgets, mode, pad, tokenizer, step, kv)
        return [score_record(it, s, b if record_budget else None)
                for it, b, s in zip(batch, budgets, scores)]

    return run_resumable(store, key, items, score, summarise, extra, batch_size, progress,
                         policy)


# ---------------------------------------------------------------------------------------------
# multiple-choice runs


def fit_items(items: Sequence[ScoringItem], limit: int | None, truncate: bool = False,
              what: str = "") -> list[ScoringItem]:
    """Items whose context and longest choice fit the model's ``limit`` positions. A longer
    one raises ``InputTooLongError`` naming it and both lengths; with ``truncate`` its context
    is cut from the start instead, and one line on stderr lists what was dropped."""
    if limit is None:
        return list(items)
    out, cut = [], []
    for it in items:
        longest = max(len(c) for c in it.choices)
        n = len(it.context) + longest
        if n <= limit:
            out.append(it)
            continue
        if longest >= limit:
            raise InputTooLongError(f"{it.uid}: a choice of {longest:,} tokens leaves no room "
                                    f"for its context in the model's {limit:,} positions")
        if not truncate:
            raise InputTooLongError(
                f"{it.uid} has {len(it.context):,} context + {longest} choice tokens = {n:,}; "
                f"the model takes at most {limit:,} (max_position_embeddings): pass "
                "--max-length or --truncate to cut the context from the start")
        cut.append((it.uid, n - limit))
        out.append(replace(it, context=it.context[n - limit:]))
    if cut:
        shown = ", ".join(f"{uid} (-{d:,})" for uid, d in cut[:5])
        more = f" and {len(cut) - 5} more" if len(cut) > 5 else ""
        print(f"warning: --truncate cut {len(cut)} of {len(items)} {what} contexts from the start "
              f"to fit the model's {limit:,} positions, {sum(d for _, d in cut):,} tokens in "
              f"all: {shown}{more}", file=sys.stderr)
    return out


def tokenize_tasks(tasks: Mapping[str, Sequence[MCExample]], tokenizer: Any,
                   max_length: int | None = None, limit: int | None = None,
                   truncate: bool = False) -> dict[str, list[ScoringItem]]:
    """Scoring items per task, cut to ``max_length`` and checked against the model's context
    ``limit`` (``fit_items``)."""
    return {task: fit_items([mc_item(ex, tokenizer, max_length) for ex in examples], limit,
                            truncate, task)
            for task, examples in tasks.items()}


def evaluate_mc(model: nn.Module, tokenizer: Any, tasks: Mapping[str, Sequence[MCExample]],
                policies: Mapping[str, Policy], budgets: Sequence[Budget], mode: str,
                store: ResultStore, *, batch_size: int = 8, max_length: int | None = None,
                progress: bool = True, truncate: bool = False,
                kv: KVQuant | None = None) -> list[str]:
    """Every (task, policy, budget) at fixed budgets; returns the result keys. ``kv``: how
    the caches of ``mode`` cache store kept entries.

    Budget-free policies (``full``, the thresholded ``attention_gate``: ``Policy.budget_free``)
    run once under the label ``none``. An example longer than the model's context is refused
    before anything is scored, or cut with ``truncate`` (``fit_items``).
    """
    check_mode(mode)
    items = tokenize_tasks(tasks, tokenizer, max_length, context_limit(model.config), truncate)
    pad = pad_id(tokenizer)
    keys = []
    pairs = sum(map(len, items.values())) * planned_runs(policies, budgets)
    with Tally(pairs, "mc", progress) as tally:
        for task, task_items in items.items():
            for name, policy in policies.items():
                buds: Sequence[Budget | None] = [None] if policy.budget_free else budgets
                for bud in buds:
                    key = make_key("mc", task, name, budget_label(bud), mode)
                    fixed = bud or Budget(ratio=1.0)
                    run_items(model, task_items, policy, lambda _uid, b=fixed: b, mode, store,
                              key, mc_summary, batch_size=batch_size, pad=pad, progress=tally,
                              record_budget=bud is not None, tokenizer=tokenizer, kv=kv)
                    keys.append(key)
    return keys


def matched_budgets(reference: Mapping[str, Any], rounding: str = "up") -> dict[str, Budget]:
    """Per-example budgets from a reference run's record: keep ``1 - evict`` of the context."""
    examples = reference.get("examples", {})
    if not examples:
        raise EvalError(f"reference run {reference.get('policy')!r} has no examples to match")
    return {uid: check_budget_ratio(1.0 - float(r["evict"]), rounding)
            for uid, r in examples.items()}


def evaluate_matched(model: nn.Module, tokenizer: Any, tasks: Mapping[str, Sequence[MCExample]],
                     policies: Mapping[str, Policy], reference: Policy, mode: str,
                     store: ResultStore, *, reference_name: str | None = None,
                     reference_budget: Budget | None = None, batch_size: int = 8,
                     max_length: int | None = None, progress: bool = True,
                     others: Callable[[], AbstractContextManager] | None = None,
                     rounding: str = "up", truncate: bool = False,
                     kv: KVQuant | None = None) -> list[str]:
    """Run ``reference`` (the learned gate; a heuristic at ``reference_budget`` works too),
    then every other policy at the reference's per-example eviction ratio (budget label
    ``matched-<reference key's policy>@<its budget>``, ``matched~...`` with ``rounding``
    "nearest"); returns the keys. ``others``: a context the other policies run in (e.g.
    peft's ``disable_adapter``: the frozen base); ``kv``: how every cache of ``mode`` cache
    stores kept entries, the reference's too."""
    check_mode(mode)
    Budget(ratio=1.0, rounding=rounding)  # a bad rounding fails before any model runs
    ref_name = reference_name or reference.name
    ref_budget = None if reference.budget_free else (reference_budget or Budget(ratio=0.5))
    ref_label = budget_label(ref_budget)
    items = tokenize_tasks(tasks, tokenizer, max_length, context_limit(model.config), truncate)
    pad = pad_id(tokenizer)
    keys = []
    runs = 1 + sum(1 for name in policies if name != ref_name)  # the reference, the others
    with Tally(sum(map(len, items.values())) * runs, "matched", progress) as tally:
        for task, task_items in items.items():
            ref_key = make_key("mc", task, ref_name, ref_label, mode)
            fixed = ref_budget or Budget(ratio=1.0)
            record = run_items(model, task_items, reference, lambda _uid, b=fixed: b, mode,
                               store, ref_key, mc_summary, batch_size=batch_size, pad=pad,
                               progress=tally, record_budget=ref_budget is not None,
                               tokenizer=tokenizer, kv=kv)
            keys.append(ref_key)
            per_example = matched_budgets(record, rounding)
            label = (("matched~" if rounding == "nearest" else "matched-") + ref_name
                     + ("" if ref_budget is None else f"@{ref_label}"))
            for name, policy in policies.items():
                if name == ref_name:
                    continue
                key = make_key("mc", task, name, label, mode)
                with (others or nullcontext)():
                    run_items(model, task_items, policy, per_example.__getitem__, mode, store,
                              key, mc_summary, batch_size=batch_size, pad=pad, progress=tally,
                              tokenizer=tokenizer, kv=kv)
                keys.append(key)
    return keys
