"""Long-context evaluations under eviction: passkey retrieval and perplexity.

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

Perplexity under eviction, the protocol: each held-out text is tokenised (cut to
``max_length`` tokens); its first ``prefix`` share (default half) is the context, which the
policy compresses; the rest is scored as one continuation that sees the kept context entries
plus itself causally. ``ppl = exp(total NLL / total scored tokens)`` over all texts, so a
policy's number is comparable with ``full`` on the same tokens.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvgate.attention.masks import left_pad
from kvgate.cache.fork import grow_capacity
from kvgate.eval.masked import EvalError, ScoringItem, model_device, model_shape, pad_id
from kvgate.eval.multiple_choice import (
    check_mode,
    encode,
    evict_summary,
    mc_summary,
    run_items,
    run_resumable,
)
from kvgate.eval.report import ResultStore, budget_label, make_key
from kvgate.inference import Engine
from kvgate.inference.compress import run_passes
from kvgate.inference.decode import left_padded_positions
from kvgate.models.limits import InputTooLongError, context_limit
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


# ---------------------------------------------------------------------------------------------
# greedy generation over a compressed cache


@torch.no_grad()
def generate_greedy(model: nn.Module, prompts: Sequence[Sequence[int]], policy: Policy,
                    budget: Budget, max_new_tokens: int = 8, pad: int = 0,
                    eos: int | None = None, suffix: Sequence[int] = (),
                    tokenizer: Any = None) -> tuple[list[list[int]], list[int], list[int]]:
    """Greedy continuation of left-padded ``prompts`` over a ``CompressedCache``; ``suffix``
    (a question) is fed after the prompts are compressed, adding to the cache, and decoding
    continues from it. ``tokenizer``: for a ``PassScoring`` policy (KVzip), whose extra
    passes run after the prefill (``kvgate.inference.compress.run_passes``).

    Returns (generated ids per prompt, kept context entries per prompt, L x H_kv x n_ctx per
    prompt). Generation stops early when every row produced ``eos``.
    """
    num_layers, kv_heads = model_shape(model)
    device = model_device(model)
    ids, mask = left_pad(prompts, pad)
    n_real = mask.sum(-1)
    cache = Engine(model, None, policy, budget).new_cache()
    pos = left_padded_positions(mask)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   position_ids=pos.to(device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    run_passes(model, tokenizer, cache, ids.to(device), mask.to(device))
    kept = sum(cache.kept_counts(layer).sum(-1) for layer in range(num_layers)).cpu()
    mask = mask.to(device)
    start = n_real.to(device)
    if suffix:
        grow_capacity(cache, torch.full((len(prompts),), len(suffix)))
        q = torch.tensor([list(suffix)] * len(prompts), device=device)
        mask = torch.cat([mask, torch.ones_like(q)], dim=1)
        logits = model(input_ids=q, attention_mask=mask,
                       position_ids=start[:, None] + torch.arange(len(suffix), device=device),
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        start = start + len(suffix)
    out = torch.empty((len(prompts), 0), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):  # a loop over decode steps
        nxt = logits.argmax(-1)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if eos is not None:
            done |= nxt == eos
            if bool(done.all()):
                break
        if step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(input_ids=nxt[:, None], attention_mask=mask,
                       position_ids=(start + step)[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]
    gen = []
    for row in out.cpu().tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        gen.append(row)
    totals = [num_layers * kv_heads * int(n) for n in n_real]
    return gen, kept.tolist(), totals


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
    if records and "hit" in next(iter(records.values())):
        n = len(records)
        return {"n": n, "acc": 100.0 * sum(bool(r["hit"]) for r in records.values()) / n,
                **evict_summary(records)}
    summary = mc_summary(records)
    summary.pop("acc_norm", None)
    return summary


def evaluate_needle(model: nn.Module, tokenizer: Any, texts: Sequence[str],
                    lengths: Sequence[int], depths: Sequence[float],
                    policies: Mapping[str, Policy], budgets: Sequence[Budget],
                    store: ResultStore, *, scoring: str = "rank", mode: str = "masked",
                    samples: int = 5, distractors: int = 9, max_new_tokens: int = 8,
                    batch_size: int = 1, seed: int = 0, progress: bool = True,
                    query_aware: bool = False) -> list[str]:
    """Accuracy per (length, depth, policy, budget); returns the result keys. The question
    comes after compression unless ``query_aware`` (see the module docstring).

    scoring ``rank`` runs in ``mode`` (masked or cache); ``generate`` always runs over the
    compressed cache. Every prompt, with its answer (rank) or ``max_new_tokens`` (generate),
    must fit the model's context: a length that does not is refused before anything is scored
    (a needle prompt is never cut: its length is what is measured).
    """
    if scoring not in ("rank", "generate"):
        raise EvalError(f"needle scoring must be 'rank' or 'generate', got {scoring!r}")
    mode = "cache" if scoring == "generate" else check_mode(mode)
    pad = pad_id(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    question = [] if query_aware else encode(tokenizer, QUESTION)
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
            cells.append((length, depth, examples, ranked))
    keys = []
    for length, depth, examples, ranked in cells:
        extra = {"length": int(length), "depth": float(depth),
                 "actual_depth": sum(ex.actual_depth for ex in examples) / len(examples)}
        for name, policy in policies.items():
            buds: Sequence[Budget | None] = [None] if policy.budget_free else budgets
            for bud in buds:
                fixed = bud or Budget(ratio=1.0)
                key = make_key("needle", f"{length}@{depth:g}", name, budget_label(bud),
                               f"{scoring}-{mode}" + ("" if query_aware else "-agnostic"))
                if scoring == "rank":
                    run_items(model, ranked, policy, lambda _u, b=fixed: b, mode, store, key,
                              needle_summary, extra, batch_size, pad, progress,
                              tokenizer=tokenizer)
                else:
                    def score(batch, policy=policy, fixed=fixed):
                        gen, kept, total = generate_greedy(
                            model, [ex.ids[:len(ex.ids) - len(question)] for ex in batch],
                            policy, fixed, max_new_tokens, pad, eos, question, tokenizer)
                        recs = []
                        for ex, g, k, t in zip(batch, gen, kept, total):
                            text = tokenizer.decode(g)
                            recs.append({"output": text, "hit": ex.key in text,
                                         "key": ex.key, "kept": k, "total": t,
                                         "evict": 1.0 - k / max(t, 1),
                                         "n_ctx": len(ex.ids)})
                        return recs

                    run_resumable(store, key, examples, score, needle_summary, extra,
                                  batch_size, progress, policy)
                keys.append(key)
    return keys


# ---------------------------------------------------------------------------------------------
# perplexity under eviction


def ppl_items(tokenizer: Any, texts: Sequence[str], max_length: int = 512,
              prefix: float = 0.5, name: str = "corpus", limit: int | None = None,
              truncate: bool = False) -> list[ScoringItem]:
    """One item per text with at least 4 tokens: context = the first ``prefix`` share of its
    first ``max_length`` tokens, the single choice = the rest. A text still longer than the
    model's ``limit`` positions is refused (``InputTooLongError``), or with ``truncate`` cut
    to them (its end dropped, as ``max_length`` does; one line on stderr says how much)."""
    if not 0.0 < prefix < 1.0:
        raise EvalError(f"ppl prefix must lie in (0, 1), got {prefix}")
    if max_length < 4:
        raise EvalError(f"ppl max_length must be >= 4, got {max_length}")
    items = []
    dropped = []
    for i, text in enumerate(texts):
        ids = encode(tokenizer, text, special=True)[:max_length]
        if limit is not None and len(ids) > limit:
            if not truncate:
                raise InputTooLongError(
                    f"text {name}:{i} has {len(ids):,} tokens (at --max-length {max_length}); "
                    f"the model takes at most {limit:,} (max_position_embeddings): pass "
                    f"--max-length {limit} or --truncate")
            dropped.append(len(ids) - limit)
            ids = ids[:limit]
        if len(ids) < 4:
            continue
        cut = min(max(1, int(len(ids) * prefix)), len(ids) - 1)
        items.append(ScoringItem(f"{name}:{i}", tuple(ids[:cut]), (tuple(ids[cut:]),), 0,
                                 (len(ids) - cut,)))
    if not items:
        raise EvalError("no text has the 4 tokens needed for perplexity under eviction")
    if dropped:
        print(f"warning: --truncate cut {len(dropped)} of {len(texts)} texts to the model's "
              f"{limit:,} positions, dropping {sum(dropped):,} tokens from their ends",
              file=sys.stderr)
    return items


def ppl_window_items(tokenizer: Any, texts: Sequence[str], context: int, continuation: int,
                     windows: int | None = None, name: str = "corpus",
                     limit: int | None = None) -> list[ScoringItem]:
    """Fixed-length items from the texts joined into one token stream (each text encoded with
    the tokenizer's own specials, then an EOS if it has one): non-overlapping windows of
    ``context + continuation`` tokens, the first ``context`` compressed, the rest scored. Every
    item then has exactly the requested context, which per-text cuts cannot promise. A window
    longer than the model's ``limit`` positions is refused (never cut: its size is the
    setting)."""
    if context < 1 or continuation < 1:
        raise EvalError(f"ppl context and continuation must be >= 1, got {context} and "
                        f"{continuation}")
    if windows is not None and windows < 1:
        raise EvalError(f"ppl windows must be >= 1, got {windows}")
    if limit is not None and context + continuation > limit:
        raise InputTooLongError(
            f"a window of --context {context:,} + --continuation {continuation:,} = "
            f"{context + continuation:,} tokens; the model takes at most {limit:,} "
            "(max_position_embeddings): use smaller windows")
    eos = getattr(tokenizer, "eos_token_id", None)
    span = context + continuation
    stream: list[int] = []
    want = None if windows is None else windows * span
    for text in texts:
        stream += encode(tokenizer, text, special=True) + ([eos] if eos is not None else [])
        if want is not None and len(stream) >= want:
            break
    count = len(stream) // span if windows is None else min(windows, len(stream) // span)
    if count == 0 or (windows is not None and count < windows):
        raise EvalError(f"the texts hold {len(stream)} tokens: too few for "
                        f"{windows or 1} window(s) of {context} + {continuation}; pass more "
                        "--docs or a smaller --windows")
    items = []
    for i in range(count):
        ids = stream[i * span:(i + 1) * span]
        items.append(ScoringItem(f"{name}:w{i}", tuple(ids[:context]), (tuple(ids[context:]),),
                                 0, (continuation,)))
    return items


def ppl_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    nll = -sum(r["ll"][0] for r in records.values())
    tokens = sum(r["tokens"][0] for r in records.values())
    ppl = math.exp(nll / tokens) if tokens else math.nan
    return {"n": len(records), "tokens": tokens, "nll": nll, "ppl": ppl,
            **evict_summary(records)}


def evaluate_ppl(model: nn.Module, tokenizer: Any, texts: Sequence[str],
                 policies: Mapping[str, Policy], budgets: Sequence[Budget], store: ResultStore,
                 *, mode: str = "masked", max_length: int = 512, prefix: float = 0.5,
                 name: str = "corpus", batch_size: int = 4, progress: bool = True,
                 context: int | None = None, continuation: int | None = None,
                 windows: int | None = None, truncate: bool = False) -> list[str]:
    """Perplexity of the second part of each text given its compressed first part; with
    ``context``, of fixed windows of the joined texts instead (``ppl_window_items``). Inputs
    longer than the model's context are refused, or (texts, with ``truncate``) cut."""
    check_mode(mode)
    continuation = continuation or context
    limit = context_limit(model.config)
    if context is not None:
        items = ppl_window_items(tokenizer, texts, context, continuation, windows, name, limit)
        extra = {"context": context, "continuation": continuation}
    else:
        items = ppl_items(tokenizer, texts, max_length, prefix, name, limit, truncate)
        extra = {"max_length": max_length, "prefix": prefix}
    pad = pad_id(tokenizer)
    keys = []
    for pname, policy in policies.items():
        buds: Sequence[Budget | None] = [None] if policy.budget_free else budgets
        for bud in buds:
            fixed = bud or Budget(ratio=1.0)
            task = name if context is None else f"{name}@{context}+{continuation}"
            key = make_key("ppl", task, pname, budget_label(bud), mode)
            run_items(model, items, policy, lambda _u, b=fixed: b, mode, store, key,
                      ppl_summary, extra, batch_size, pad, progress, record_budget=bud is not None,
                      tokenizer=tokenizer)
            keys.append(key)
    return keys
