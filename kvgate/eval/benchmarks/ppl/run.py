"""Perplexity under eviction, the protocol: each held-out text is tokenised (cut to
``max_length`` tokens); its first ``prefix`` share (default half) is the context, which the
policy compresses; the rest is scored as one continuation that sees the kept context entries
plus itself causally. ``ppl = exp(total NLL / total scored tokens)`` over all texts, so a
policy's number is comparable with ``full`` on the same tokens.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from kvgate.cache.quant import KVQuant
from kvgate.eval.errors import EvalError, encode
from kvgate.eval.masked import ScoringItem
from kvgate.eval.multiple_choice import check_mode, run_items
from kvgate.eval.resumable import Tally, evict_summary, planned_runs
from kvgate.eval.store import ResultStore, budget_label, make_key
from kvgate.models.limits import InputTooLongError, context_limit
from kvgate.models.load import pad_id
from kvgate.policies.base import Budget, Policy


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
                     limit: int | None = None, from_files: bool = False) -> list[ScoringItem]:
    """Fixed-length items from the texts joined into one token stream (each text encoded with
    the tokenizer's own specials, then an EOS if it has one): non-overlapping windows of
    ``context + continuation`` tokens, the first ``context`` compressed, the rest scored. Every
    item then has exactly the requested context, which per-text cuts cannot promise. A window
    longer than the model's ``limit`` positions is refused (never cut: its size is the
    setting), as are texts too short for the windows asked, with advice for where they came
    from: ``from_files`` (``--text-files``) or the corpus (``--docs``)."""
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
        raise EvalError(_too_short(len(stream), count, windows, context, continuation,
                                   from_files))
    items = []
    for i in range(count):
        ids = stream[i * span:(i + 1) * span]
        items.append(ScoringItem(f"{name}:w{i}", tuple(ids[:context]), (tuple(ids[context:]),),
                                 0, (continuation,)))
    return items


def _too_short(tokens: int, count: int, windows: int | None, context: int, continuation: int,
               from_files: bool) -> str:
    """Why the texts hold too few windows, and what would give more: more text (longer
    --text-files, or more --docs of the corpus), fewer windows, or smaller ones."""
    held = (f"--text-files: the files hold {tokens:,} tokens" if from_files
            else f"--docs: the corpus' texts hold {tokens:,} tokens")
    ways = ["give longer or more files" if from_files else "pass more --docs"]
    if count:  # some windows fit: asking for no more than those is a way too
        ways.append(f"--windows {count}")
    ways.append("a smaller --context / --continuation")
    return (f"{held}, too few for {windows or 1} window(s) of --context {context:,} + "
            f"--continuation {continuation:,} = {context + continuation:,}; "
            f"{', '.join(ways[:-1])} or {ways[-1]}")


def ppl_summary(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    nll = -sum(r["ll"][0] for r in records.values())
    tokens = sum(r["tokens"][0] for r in records.values())
    ppl = math.exp(nll / tokens) if tokens else math.nan
    out = {"n": len(records), "tokens": tokens, "nll": nll, "ppl": ppl,
           **evict_summary(records)}
    shares = [r["held_end_share"][0] for r in records.values() if "held_end_share" in r]
    if shares and len(shares) == len(records):
        # the cache's size after the continuation over all positions seen (context and
        # continuation): below the context's kept share where a policy evicts while decoding
        out["held_end_pct"] = 100.0 * sum(shares) / len(shares)
    return out


def evaluate_ppl(model: nn.Module, tokenizer: Any, texts: Sequence[str],
                 policies: Mapping[str, Policy], budgets: Sequence[Budget], store: ResultStore,
                 *, mode: str = "masked", max_length: int = 512, prefix: float = 0.5,
                 name: str = "corpus", batch_size: int = 4, progress: bool = True,
                 context: int | None = None, continuation: int | None = None,
                 windows: int | None = None, truncate: bool = False,
                 step: int | None = None, from_files: bool = False,
                 kv: KVQuant | None = None) -> list[str]:
    """Perplexity of the second part of each text given its compressed first part; with
    ``context``, of fixed windows of the joined texts instead (``ppl_window_items``). Inputs
    longer than the model's context are refused, or (texts, with ``truncate``) cut. ``step``
    (cache mode): the continuation is fed that many tokens per forward with an eviction round
    after each, so a decode-evicting policy (H2O, TOVA, StreamingLLM, a local gate) scores it
    while holding its capacity, as it would while generating. ``from_files``: the texts are
    ``--text-files``' (what a refusal advises). ``kv`` (cache mode): how the caches store
    kept entries (None: as the model gives them)."""
    check_mode(mode)
    if step is not None and mode != "cache":
        raise EvalError("ppl --step feeds the continuation through a real cache: use --mode cache")
    continuation = continuation or context
    limit = context_limit(model.config)
    if context is not None:
        items = ppl_window_items(tokenizer, texts, context, continuation, windows, name, limit,
                                 from_files)
        extra = {"context": context, "continuation": continuation}
    else:
        items = ppl_items(tokenizer, texts, max_length, prefix, name, limit, truncate)
        extra = {"max_length": max_length, "prefix": prefix}
    if step is not None:
        extra["step"] = step
    pad = pad_id(tokenizer)
    keys = []
    with Tally(len(items) * planned_runs(policies, budgets), "ppl", progress) as tally:
        for pname, policy in policies.items():
            buds: Sequence[Budget | None] = [None] if policy.budget_free else budgets
            for bud in buds:
                fixed = bud or Budget(ratio=1.0)
                task = name if context is None else f"{name}@{context}+{continuation}"
                key = make_key("ppl", task, pname, budget_label(bud), mode)
                run_items(model, items, policy, lambda _u, b=fixed: b, mode, store, key,
                          ppl_summary, extra, batch_size, pad, tally,
                          record_budget=bud is not None, tokenizer=tokenizer, step=step,
                          kv=kv)
                keys.append(key)
    return keys
