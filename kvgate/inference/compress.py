"""Compress once, ask many: a context is compressed without its question, then each question
is answered over its own fork of the compressed cache.

This is the setting the field compares eviction methods in (kvpress, RULER): the policy sees
the context's prefill only, never a question, and one compressed context serves any number of
questions. ``Engine.compress`` / ``Engine.answer`` are the entry points; the work is here.

Chat template: when the tokenizer has one (and ``chat`` is on), context and question form one
user turn as the template writes it. The template is rendered once around a marker; what
precedes the marker plus the context plus ``SEPARATOR`` is compressed, and the question, the
turn's closing tokens, the generation prompt and the answer prefix come after. Without a
template the context is compressed as is and ``SEPARATOR + question`` (+ a new line and the
answer prefix) follows.

A ``PassScoring`` policy (KVzip) chooses after extra passes of the model over the prefilled
cache: ``run_passes`` feeds them (``Engine.prefill`` / ``generate`` and ``compress`` call it,
inside the time they report), asking its requests the way a question is asked here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvgate.attention.masks import left_pad
from kvgate.cache import CompressedCache
from kvgate.cache.fork import fork_cache, grow_capacity
from kvgate.cache.passes import choose_all, extra_pass
from kvgate.cache.quant import KVQuant
from kvgate.cache.shared import SharedPrefill
from kvgate.cache.shared_passes import SharedPasses, share_group
from kvgate.inference.decode import decode, left_padded_positions, until_eos
from kvgate.models.limits import InputTooLongError, context_limit, fit_to_context
from kvgate.models.load import pad_id, sync_device
from kvgate.policies.base import Budget, Policy, PolicyError
from kvgate.policies.contract import Ask, PassScoring

SEPARATOR = "\n\n"  # between the context and the question, in both forms
_MARK = "\u2063KVGATE-QUESTION-SPLIT\u2063"


@dataclass
class CompressedContext:
    """One or more contexts, prefilled and compressed under the engine's policy.

    ``cache`` is never modified by ``answer``: every question runs on a fork of it.
    """

    cache: CompressedCache
    input_ids: Tensor  # [B, n] left padded context tokens
    attention_mask: Tensor  # [B, n]
    chat: bool  # the question goes inside the chat template's user turn
    suffix: str  # template text after the question (turn end + generation prompt); "" if plain
    contexts: list[str] = field(default_factory=list)
    kept_fraction: float = 1.0
    kept_fraction_per_layer: list[float] = field(default_factory=list)
    bytes_held: int = 0
    bytes_full: int = 0
    compress_ms: float = 0.0

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Real tokens per context."""
        return self.attention_mask.sum(-1).tolist()


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_parts(tokenizer: Any) -> tuple[str, str]:
    """``(head, tail)``: the template's text of one user turn before and after its content
    (the tail includes the generation prompt)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}],
                                         add_generation_prompt=True, tokenize=False)
    if text.count(_MARK) != 1:
        raise PolicyError("the chat template does not write the user's message verbatim; "
                          "use chat=False (--no-chat)")
    head, _, tail = text.partition(_MARK)
    return head, tail


def split_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str | None = None,
                 chat: bool = True) -> tuple[str, str]:
    """``(context part, question part)`` of one prompt: the first is compressed, the second
    follows. With a template, their concatenation is exactly the template's text of the user
    turn ``context + SEPARATOR + question`` (generation prompt included) + ``answer_prefix``."""
    if chat and has_chat_template(tokenizer):
        head, tail = chat_parts(tokenizer)
        return head + context + SEPARATOR, question + tail + (answer_prefix or "")
    prefix = f"\n{answer_prefix}" if answer_prefix else ""
    return context, SEPARATOR + question + prefix


def asker(tokenizer: Any, chat: bool) -> Ask:
    """``ask(text, extra)``: the ids of a request asked after a prompt, like a question here:
    with the template, ``text`` + ``extra`` + the user turn's end and generation prompt (the
    prompt left the turn open); plain, ``SEPARATOR + text`` + ``extra`` + a new line."""
    tail = chat_parts(tokenizer)[1] if chat else "\n"

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def ask(text: str, extra: Sequence[int]) -> list[int]:
        return ids(text if chat else SEPARATOR + text) + list(extra) + ids(tail)

    return ask


@torch.no_grad()
def run_passes(model: Any, tokenizer: Any, cache: CompressedCache, ids: Tensor, mask: Tensor,
               chat: bool | None = None, choose: bool = True) -> None:
    """A ``PassScoring`` policy's extra passes over a prefilled ``cache`` (prompt ``ids`` /
    ``mask`` [B, n], left padded), then its choice for every layer; nothing for any other
    policy. ``chat``: ask through the chat template (default: where the tokenizer has one).
    ``choose=False`` stops before the choice: the cache still holds every entry and the
    passes' scores (``kvgate.cache.passes.running_scores``; the oracle labels read them)."""
    if not (isinstance(cache.policy, PassScoring) and cache.awaiting_passes):
        return
    if tokenizer is None:
        raise PolicyError(f"policy {cache.policy.name!r} asks the model to repeat the "
                          "context: it needs the tokenizer")
    chat = has_chat_template(tokenizer) if chat is None else chat and has_chat_template(tokenizer)
    start = mask.sum(-1)  # [B]: each pass continues after the real prompt
    for pass_ids, valid in cache.policy.passes(ids, mask.bool(), asker(tokenizer, chat)):
        positions = (start[:, None] + valid.long().cumsum(-1) - 1).clamp(min=0)
        with extra_pass(cache, valid):  # a loop over passes (KVzip: chunks)
            model(input_ids=pass_ids, attention_mask=torch.cat([mask, valid.long()], dim=1),
                  position_ids=positions, past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    if choose:
        choose_all(cache)


def _tokenizer_ready(tokenizer: Any) -> None:
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token


def compress(engine: Any, contexts: str | list[str], chat: bool = True,
             reserve: int = 1) -> CompressedContext:
    """Prefill ``contexts`` (left padded) under the engine's policy; no question is involved.
    ``reserve``: tokens that will follow each context (its longest question and the new
    tokens; ``question_room``), so that ``engine.truncate`` cuts a context to what leaves them
    room, and a refusal advises a length that fits."""
    return _prefill_contexts(engine, contexts, chat, engine.new_cache(), reserve)


def question_room(engine: Any, questions: list[str], max_new_tokens: int,
                  answer_prefix: str | None = None, chat: bool = True) -> int:
    """The tokens the longest of ``questions`` (as ``answer`` asks it) and ``max_new_tokens``
    add after a compressed context."""
    tok = engine.tokenizer
    chat = bool(chat) and has_chat_template(tok)
    tail = chat_parts(tok)[1] if chat else ""
    shape = CompressedContext(None, None, None, chat, tail)  # only chat and suffix are read
    longest = max(len(tok(_question_text(shape, q, answer_prefix),
                          add_special_tokens=False)["input_ids"]) for q in questions)
    return longest + max_new_tokens


def compress_shared(engine: Any, contexts: str | list[str],
                    variants: Mapping[str, tuple[Policy, Budget | float | str]],
                    chat: bool = True) -> tuple[dict[str, CompressedContext], dict[str, float]]:
    """``contexts`` compressed under every one-shot ``variants[name] = (policy, budget)`` from a
    single prefill (``kvgate.cache.shared.SharedPrefill``), or under ``PassScoring`` variants
    reading the same passes from a single prefill and run of the passes
    (``kvgate.cache.shared_passes.SharedPasses``): each result equals
    ``Engine(model, tokenizer, policy, budget).compress(contexts)`` and is answered with
    ``answer`` like one. Also returns each variant's own seconds (its choice).
    ``compress_ms`` of every result is the shared prefill's (and passes')."""
    shared = _shared_cache(engine, variants)
    lead = _prefill_contexts(engine, contexts, chat, shared,
                             choose=not isinstance(shared, SharedPasses))
    return _split_shared(lead, shared, getattr(engine, "kv", None))


def compress_rows_shared(engine: Any, rows: list[list[int]],
                         variants: Mapping[str, tuple[Policy, Budget | float | str]],
                         ) -> tuple[dict[str, CompressedContext], dict[str, float]]:
    """:func:`compress_shared` of contexts already tokenised (``prefill_rows``)."""
    shared = _shared_cache(engine, variants)
    lead = prefill_rows(engine, rows, shared, choose=not isinstance(shared, SharedPasses))[0]
    return _split_shared(lead, shared, getattr(engine, "kv", None))


def _shared_cache(engine: Any, variants: Mapping[str, tuple[Policy, Budget | float | str]],
                  ) -> SharedPrefill | SharedPasses:
    """What serves every variant from one prefill: a ``SharedPasses`` when all are
    ``PassScoring`` policies reading the same passes, else a ``SharedPrefill`` (which refuses
    any policy it cannot serve)."""
    groups = {share_group(policy) for policy, _ in variants.values()}
    if len(groups) == 1 and isinstance(next(iter(groups)), tuple):
        return SharedPasses(engine.model, variants)
    return SharedPrefill(engine.model, variants)


def _split_shared(lead: CompressedContext, shared: SharedPrefill | SharedPasses,
                  kv: KVQuant | None = None,
                  ) -> tuple[dict[str, CompressedContext], dict[str, float]]:
    """Each variant's cache as a compressed context; held as ``kv`` says (the shared prefill
    fills full-precision caches: each is converted here, inside its variant's seconds)."""
    caches, seconds = (shared.split() if isinstance(shared, SharedPasses)
                       else (shared.caches, shared.seconds))
    seconds = dict(seconds)
    if kv is not None and kv.quantized:
        for name, cache in caches.items():
            t0 = time.perf_counter()
            cache.store_as(kv)
            sync_device(lead.input_ids.device)
            seconds[name] += time.perf_counter() - t0
    out = {name: CompressedContext(cache, lead.input_ids, lead.attention_mask, lead.chat,
                                   lead.suffix, lead.contexts, cache.kept_fraction(),
                                   cache.kept_fractions(), cache.bytes_held(), cache.full_bytes(),
                                   lead.compress_ms)
           for name, cache in caches.items()}
    return out, seconds


@torch.no_grad()
def _prefill_contexts(engine: Any, contexts: str | list[str], chat: bool,
                      cache: CompressedCache, reserve: int = 1,
                      choose: bool = True) -> CompressedContext:
    contexts = [contexts] if isinstance(contexts, str) else list(contexts)
    if not contexts or any(not isinstance(c, str) or not c.strip() for c in contexts):
        raise PolicyError("contexts must be a non-empty list of non-empty strings")
    tok = engine.tokenizer
    _tokenizer_ready(tok)
    chat = bool(chat) and has_chat_template(tok)
    head, tail = chat_parts(tok) if chat else ("", "")
    if chat:  # the template already writes any special tokens
        rows = [tok(head + c + SEPARATOR, add_special_tokens=False)["input_ids"] for c in contexts]
    else:
        rows = [tok(c)["input_ids"] for c in contexts]
    rows = fit_to_context(rows, context_limit(engine.model.config), reserve,
                          getattr(engine, "truncate", False), what="context",
                          reserved="tokens for the question and its answer" if reserve > 1
                          else "new tokens")
    return prefill_rows(engine, rows, cache, chat, tail, contexts, pass_chat=chat,
                        choose=choose)[0]


@torch.no_grad()
def prefill_rows(engine: Any, rows: list[list[int]], cache: CompressedCache, chat: bool = False,
                 suffix: str = "", contexts: list[str] | None = None,
                 pass_chat: bool | None = None,
                 choose: bool = True) -> tuple[CompressedContext, Any]:
    """Prefill token ``rows`` (left padded) into ``cache``: the compressed context and the
    forward's output (its last logits predict each row's next token). A ``PassScoring``
    policy's passes run before the choice; ``pass_chat`` is how they ask (``run_passes``'s
    ``chat``: None, the chat template where the tokenizer has one); ``choose=False`` stops
    before the choice (a ``SharedPasses`` chooses per variant)."""
    ids, mask = left_pad(rows, pad_id(engine.tokenizer))
    device = engine.device
    ids, mask = ids.to(device), mask.to(device)
    sync_device(device)
    t0 = time.perf_counter()
    out = engine.model(input_ids=ids, attention_mask=mask,
                       position_ids=left_padded_positions(mask), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
    run_passes(engine.model, engine.tokenizer, cache, ids, mask, pass_chat, choose)
    sync_device(device)
    ms = 1000.0 * (time.perf_counter() - t0)
    return CompressedContext(cache, ids, mask, chat, suffix, list(contexts or []),
                             cache.kept_fraction(), cache.kept_fractions(), cache.bytes_held(),
                             cache.full_bytes(), ms), out


def answer(engine: Any, compressed: CompressedContext, questions: list[str],
           max_new_tokens: int = 32, answer_prefix: str | None = None) -> list[str]:
    """One context: an answer per question. Several contexts: ``questions[i]`` is asked of
    context ``i`` (one question each). Greedy; each question runs on its own fork."""
    questions = [questions] if isinstance(questions, str) else list(questions)
    if compressed.batch == 1:
        per_context = [questions]
    elif len(questions) == compressed.batch:
        per_context = [[q] for q in questions]
    else:
        raise PolicyError(f"{compressed.batch} contexts need one question each, got "
                          f"{len(questions)} (or compress the contexts one at a time)")
    texts, _ = answer_all(engine, compressed, per_context, max_new_tokens, answer_prefix)
    return [t for row in texts for t in row]


@torch.no_grad()
def answer_all(engine: Any, compressed: CompressedContext, questions: list[list[str]],
               max_new_tokens: int = 32, answer_prefix: str | None = None,
               ) -> tuple[list[list[str]], list[list[list[int]]]]:
    """``questions[b]``: the questions for context ``b``. Round ``k`` forks the cache once and
    asks every context its ``k``-th question (a context with fewer questions repeats its last
    one, and that answer is dropped). Returns ``(texts, token_ids)`` shaped like ``questions``.
    """
    if len(questions) != compressed.batch:
        raise PolicyError(f"questions for {len(questions)} contexts, but {compressed.batch} "
                          "were compressed")
    if any(not row or any(not isinstance(q, str) or not q.strip() for q in row)
           for row in questions):
        raise PolicyError("every context needs at least one non-empty question")
    if max_new_tokens < 1:
        raise PolicyError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    texts: list[list[str]] = [[] for _ in questions]
    ids: list[list[list[int]]] = [[] for _ in questions]
    for k in range(max(len(row) for row in questions)):  # a loop over questions
        batch = [row[min(k, len(row) - 1)] for row in questions]
        rows = _answer_round(engine, compressed, batch, max_new_tokens, answer_prefix)
        for b, row in enumerate(rows):
            if k < len(questions[b]):
                ids[b].append(row)
                texts[b].append(engine.tokenizer.decode(row, skip_special_tokens=True))
    return texts, ids


def _answer_round(engine: Any, compressed: CompressedContext, questions: list[str],
                  max_new_tokens: int, answer_prefix: str | None) -> list[list[int]]:
    """Each context's question, then greedy decoding, on one fork: token ids per context."""
    tok = engine.tokenizer
    _tokenizer_ready(tok)
    parts = [_question_text(compressed, q, answer_prefix) for q in questions]
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in parts]
    _check_fits(engine, compressed, rows, max_new_tokens)
    return answer_rows(engine, compressed, rows, max_new_tokens)


@torch.no_grad()
def answer_rows(engine: Any, compressed: CompressedContext, rows: list[list[int]],
                max_new_tokens: int, until: Callable[[Tensor], Tensor] | None = None,
                room: int = 0) -> list[list[int]]:
    """Question token ``rows`` (one per context, non-empty) fed over a fork of the cache,
    then greedy decoding: the token ids per context, up to and with EOS (or until ``until``
    says a row is done: ``kvgate.inference.decode.decode``). ``room``: decoded tokens that
    add to the cache before a decode-evicting policy evicts (teacher scoring's lead-in)."""
    device = engine.device
    q_ids, q_mask = left_pad(rows, pad_id(engine.tokenizer))
    q_ids, q_mask = q_ids.to(device), q_mask.to(device)
    start = compressed.attention_mask.sum(-1)  # [B] real context tokens: the next position
    positions = (start[:, None] + q_mask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([compressed.attention_mask, q_mask], dim=1)
    cache = fork_cache(compressed.cache)
    grow_capacity(cache, q_mask.sum(-1) + room)  # the question adds to the context
    out = engine.model(input_ids=q_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
    return decode_after(engine, out, mask, positions[:, -1:] + 1, cache, max_new_tokens, until)


def decode_after(engine: Any, out: Any, mask: Tensor, next_pos: Tensor, cache: Any,
                 max_new_tokens: int, until: Callable[[Tensor], Tensor] | None = None,
                 ) -> list[list[int]]:
    """Greedy decoding after a forward whose output is ``out`` (``kvgate.inference.decode``),
    each row cut after its EOS."""
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    generated, _ = decode(engine.model, out, mask, next_pos, cache, max_new_tokens, eos,
                          pad_id(engine.tokenizer), graphs=engine.graphs,
                          until=until)
    return [until_eos(row, eos) for row in generated]


def _question_text(compressed: CompressedContext, question: str, answer_prefix: str | None) -> str:
    if compressed.chat:
        return question + compressed.suffix + (answer_prefix or "")
    prefix = f"\n{answer_prefix}" if answer_prefix else ""
    return SEPARATOR + question + prefix


def _check_fits(engine: Any, compressed: CompressedContext, rows: list[list[int]],
                max_new_tokens: int) -> None:
    limit = context_limit(engine.model.config)
    if limit is None:
        return
    for i, (n_ctx, row) in enumerate(zip(compressed.lengths, rows)):
        total = n_ctx + len(row) + max_new_tokens
        if total > limit:
            raise InputTooLongError(
                f"context {i} ({n_ctx:,} tokens) + question ({len(row):,}) + {max_new_tokens} "
                f"new tokens = {total:,}; the model takes at most {limit:,}")


def budget_text(policy: Any, budget: Any) -> str:
    """The budget as the statistics say it: a policy that sets its own eviction
    (``budget_free``: the full cache, a thresholded gate) keeps what its rule keeps, whatever
    ``budget`` holds, so none is claimed for it."""
    return "no budget: its own rule" if policy.budget_free else budget.describe()


def bytes_held_text(held: int, full: int) -> str:
    """The "KV bytes held" cell of a terminal table: what the compressed cache holds against
    the dense cache of the same tokens (quantized: codes, scales and zero points counted)."""
    ratio = held / full if full else float("nan")
    return f"{held:,} (K/V + positions) of {full:,} dense ({ratio:.3f}x)"


def two_columns(rows: Sequence[tuple[str, str]]) -> str:
    """(label, value) rows as a two-column text table for terminals."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
