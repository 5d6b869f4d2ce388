"""One example asked under a policy, the two ways long-context benchmarks ask it.

- :func:`compress_then_answer` (question-agnostic, the field's setting: kvpress, RULER under
  eviction): ``Engine.compress`` runs the policy on the context alone, then ``Engine.answer``
  asks the question over the compressed cache, so the policy never sees the question;
- :func:`prefill_then_decode` (query-aware): context and question are prefilled together under
  the policy, which then sees the question, and decoding follows.

Both return what a benchmark record needs: the answer text, the kept and total prompt entries
(``layers x KV heads x tokens``) and the seconds of compress + answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from kvgate.eval.masked import model_shape, pad_id
from kvgate.policies.base import Budget, Policy
from kvgate.policies.contract import DecodeEvicting


@dataclass(frozen=True)
class Asked:
    text: str
    kept: int
    total: int
    seconds: float

    def record(self) -> dict[str, Any]:
        """The fields every benchmark record stores: answer, kept / total entries, eviction
        share and seconds (each benchmark adds its score and its own fields)."""
        return {"output": self.text, "kept": self.kept, "total": self.total,
                "evict": 1.0 - self.kept / max(self.total, 1), "seconds": self.seconds}


def compress_then_answer(model: nn.Module, tokenizer: Any, context: str, question: str,
                         answer_prefix: str | None, max_new_tokens: int, policy: Policy,
                         budget: Budget, chat: bool) -> Asked:
    """Compress ``context``, then ask ``question`` (and its answer prefix) over the cache."""
    from kvgate.inference import Engine

    layers, heads = model_shape(model)
    engine = Engine(model, tokenizer, policy, budget)
    t0 = time.perf_counter()
    compressed = engine.compress(context, chat=chat)
    text = engine.answer(compressed, [question], max_new_tokens=max_new_tokens,
                         answer_prefix=answer_prefix)[0]
    seconds = time.perf_counter() - t0
    total = layers * heads * compressed.lengths[0]
    return Asked(text, round(compressed.kept_fraction * total), total, seconds)


def compress_shared_then_answer(model: nn.Module, tokenizer: Any, context: str, question: str,
                                answer_prefix: str | None, max_new_tokens: int,
                                variants: Mapping[str, tuple[Policy, Budget]],
                                chat: bool) -> dict[str, Asked]:
    """:func:`compress_then_answer` for several one-shot ``variants[name] = (policy, budget)``:
    one shared prefill (``kvgate.inference.compress.compress_shared``), then the question is
    answered over every compressed cache at once, as the rows of one batch
    (``kvgate.cache.fork.stack_caches``; a decode-evicting policy's budgets form a batch of
    their own, decoded under it). The answers are each variant's own run's, up to the float
    rounding a batch may change. A variant's seconds are its share of the run: the prefill
    less the other variants' choosing, plus its batch's answer divided by the batch size."""
    from kvgate.cache.fork import stack_caches
    from kvgate.inference import Engine
    from kvgate.inference.compress import CompressedContext, answer_all, compress_shared

    layers, heads = model_shape(model)
    engine = Engine(model, tokenizer, "full", 1.0)
    t0 = time.perf_counter()
    compressed, own = compress_shared(engine, context, variants, chat=chat)
    prefill = time.perf_counter() - t0 - sum(own.values())
    groups: dict[Any, list[str]] = {}
    for name, (policy, _) in variants.items():
        groups.setdefault(id(policy) if isinstance(policy, DecodeEvicting) else None,
                          []).append(name)
    out = {}
    for names in groups.values():
        t1 = time.perf_counter()
        one = compressed[names[0]]
        rows = len(names)
        batch = CompressedContext(stack_caches([compressed[n].cache for n in names]),
                                  one.input_ids.expand(rows, -1), one.attention_mask.expand(rows, -1),
                                  one.chat, one.suffix, one.contexts * rows)
        texts, _ = answer_all(engine, batch, [[question]] * rows, max_new_tokens, answer_prefix)
        share = (time.perf_counter() - t1) / rows
        for name, text in zip(names, texts):
            total = layers * heads * one.lengths[0]
            kept = round(compressed[name].kept_fraction * total)
            out[name] = Asked(text[0], kept, total, prefill + own[name] + share)
    return {name: out[name] for name in variants}


def prefill_then_decode(model: nn.Module, tokenizer: Any, ids: Sequence[int],
                        max_new_tokens: int, policy: Policy, budget: Budget) -> Asked:
    """Prefill ``ids`` (context and question) under the policy, then decode greedily."""
    from kvgate.eval.needle import generate_greedy

    t0 = time.perf_counter()
    gen, kept, total = generate_greedy(model, [list(ids)], policy, budget, max_new_tokens,
                                       pad_id(tokenizer), getattr(tokenizer, "eos_token_id", None),
                                       tokenizer=tokenizer)
    seconds = time.perf_counter() - t0
    return Asked(tokenizer.decode(gen[0], skip_special_tokens=True), kept[0], total[0], seconds)
