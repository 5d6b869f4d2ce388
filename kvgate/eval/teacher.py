"""Answers scored in one forward (``--score teacher``): after the question, each gold answer's
tokens are fed once over a fork of the compressed cache, and every position's logits give

- the answer's mean log-likelihood per token, and
- *greedy-exact*: every gold token is the argmax at its position, which is exactly when greedy
  decoding, after its formatting lead-in, would begin with the gold answer.

The lead-in: small models often open an answer with formatting before it (SmolLM2 answers a
needle question with ":\\n\\n1. 8001569"), so the gold answer is rarely the argmax right after
the question although generation finds it (RULER scores by substring). Teacher scoring
therefore decodes greedily for at most :data:`LEAD_TOKENS` tokens until the text leaves the
formatting (:func:`formatting_lead_in`: white space, ``:``, ``-``, ``*``, ``#``, ``>``,
quotes, then at most one list marker such as ``1.``), and feeds the gold answer after that
lead-in (re-tokenised as it would follow it). Where answers are also generated, the lead-in is
read from the generation instead (no extra step; the same tokens unless a policy evicted
during them). A record keeps the lead-in's tokens and the answer's, so the score is
reproducible.

One forward per gold answer (plus the few lead-in steps) instead of a decode step per generated
token. The lead-in's and answer's tokens add to the cache and evict nothing (as the question
does; several policies' caches then answer as one batch), so for a policy that evicts while
decoding (H2O, TOVA, ...) greedy-exact can differ from what its decoding would give on long
answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from kvgate.eval.errors import EvalError

# at most this many greedy tokens before the answer (":\n\n1. " is 6 SmolLM2 tokens, and a
# 2-digit list number needs one more to be told from an answer starting with digits)
LEAD_TOKENS = 8

_MARKS = r"[\s:*#>\"'`\-]*"  # formatting an answer may open with
_FULL = re.compile(_MARKS + r"(?:\d{1,2}[.)]\s+)?")  # ... then at most one list number
_OPEN = re.compile(_MARKS + r"(?:\d{1,2}[.)]?)?")  # a text that may still become a lead-in


def formatting_lead_in(text: str, final: bool = False) -> int | None:
    """The length in characters of ``text``'s formatting lead-in, or None while undecided
    (every character so far is formatting, or the tail may still become a list number such
    as "1." before an answer); ``final``: no more text comes, so decide now."""
    end = _FULL.match(text).end()
    if final:
        return end
    if end == len(text) or _OPEN.fullmatch(text):
        return None
    return end


@dataclass(frozen=True)
class TeacherScore:
    ll: float  # mean log-likelihood per answer token
    exact: bool  # every answer token is the argmax at its position
    tokens: tuple[int, ...]  # the answer's tokens as fed
    lead: tuple[int, ...] = ()  # the greedy lead-in fed before them

    def record(self) -> dict:
        return {**asdict(self), "tokens": list(self.tokens), "lead": list(self.lead)}


def answer_tokens(tokenizer, prompt_end: str, answer: str) -> tuple[int, ...]:
    """The tokens greedy decoding would write for ``answer`` after a prompt ending in
    ``prompt_end``: a space first unless the prompt ends in white space (an answer prefix such
    as "... is" is followed by " 42"; a chat template's generation prompt ends in a new line)."""
    lead = "" if not prompt_end or prompt_end[-1].isspace() else " "
    return tuple(tokenizer(lead + answer, add_special_tokens=False)["input_ids"])


def lead_in_tokens(tokenizer, greedy: Sequence[int], eos: int | None) -> tuple[int, ...]:
    """The longest start of ``greedy`` (a greedy continuation) inside its formatting lead-in."""
    row = list(greedy)
    if eos is not None and eos in row:
        row = row[:row.index(eos)]
    end = None
    for k in range(1, len(row) + 1):  # <= LEAD_TOKENS steps, once per example
        end = formatting_lead_in(tokenizer.decode(row[:k]), final=k == len(row))
        if end is not None:
            break
    if not end:
        return ()
    k = 0
    while k < len(row) and len(tokenizer.decode(row[:k + 1])) <= end:
        k += 1
    return tuple(row[:k])


def lead_in_rule(tokenizer) -> Callable[[Tensor], Tensor]:
    """``decode``'s stop rule for the lead-in: a row is done once its lead-in is decided."""
    def until(tokens: Tensor) -> Tensor:
        return torch.tensor([formatting_lead_in(tokenizer.decode(row)) is not None
                             for row in tokens.tolist()])
    return until


def gold_after_lead(tokenizer, question, lead: Sequence[int]) -> list[tuple[int, ...]]:
    """The gold answers' tokens after ``lead``: as stored when there is no lead-in, else
    re-tokenised after the lead-in's text."""
    if not lead:
        return list(question.answers)
    text = tokenizer.decode(list(lead))
    return [answer_tokens(tokenizer, text, a) for a in question.texts]


@torch.no_grad()
def teacher_scores(engine, compressed, question, first: Tensor | None = None,
                   greedy: Sequence[Sequence[int]] | None = None) -> list[list[TeacherScore]]:
    """Per row of ``compressed`` (a ``CompressedContext``), a score per gold answer of
    ``question`` (``kvgate.eval.asked.Question``: its tokens, the same for every row, then its
    answers). ``first`` [B, V]: the logits that predict the answer's first token when the
    question's tokens are empty (those of the forward that filled the cache). ``greedy``: each
    row's greedy generation when it ran (its start is the lead-in), else the lead-in is
    decoded here; no lead-in without the answers' texts (``question.texts``)."""
    from kvgate.cache.fork import fork_cache, grow_capacity
    from kvgate.models.load import pad_id

    model, tok = engine.model, engine.tokenizer
    lead = list(question.ids)
    if not question.answers or any(not a for a in question.answers):
        raise EvalError("teacher scoring needs at least one gold answer, each with tokens")
    if not lead and first is None:
        raise EvalError("teacher scoring needs the question's tokens or the logits before them")
    rows = compressed.batch
    eos = getattr(tok, "eos_token_id", None)
    if not question.texts:
        leads = [()] * rows
    else:
        if greedy is None:
            greedy = _greedy_lead(engine, compressed, lead, first)
        leads = [lead_in_tokens(tok, g[:LEAD_TOKENS], eos) for g in greedy]
    golds = [gold_after_lead(tok, question, leads[b]) for b in range(rows)]
    device = compressed.attention_mask.device
    start = compressed.attention_mask.sum(-1)
    out: list[list[TeacherScore]] = [[] for _ in range(rows)]
    for a in range(len(question.answers)):  # a forward per gold answer
        seqs = [lead + list(leads[b]) + list(golds[b][a]) for b in range(rows)]
        fed = max(len(s) for s in seqs) - 1
        parts = [] if first is None else [first.float()[:, None]]
        if fed > 0:  # right padding: causal, so a row's pads follow every position it reads
            pad = pad_id(tok)
            ids = torch.tensor([s[:-1] + [pad] * (fed + 1 - len(s)) for s in seqs],
                               device=device)
            cache = fork_cache(compressed.cache)
            grow_capacity(cache, torch.full((rows,), fed))
            mask = torch.cat([compressed.attention_mask, torch.ones_like(ids)], dim=1)
            pos = start[:, None] + torch.arange(fed, device=device)
            parts.append(model(input_ids=ids, attention_mask=mask, position_ids=pos,
                               past_key_values=cache, use_cache=True).logits.float())
        if first is None:  # position t of ``logits`` predicts token t of a row's sequence
            parts.insert(0, parts[0][:, :1])  # never read: the question comes first
        logits = torch.cat(parts, dim=1)
        for b in range(rows):  # a row's answer sits after its own lead-in
            gold = torch.tensor(golds[b][a], device=device)
            at = logits[b, len(lead) + len(leads[b]):][:len(gold)]
            logp = at.gather(-1, gold[:, None])[:, 0] - torch.logsumexp(at, dim=-1)
            out[b].append(TeacherScore(float(logp.double().mean()),
                                       bool((at.argmax(-1) == gold).all()),
                                       tuple(golds[b][a]), tuple(leads[b])))
    return out


@dataclass
class _Logits:  # the forward output ``decode`` reads its first step from
    logits: Tensor


def _greedy_lead(engine, compressed, lead: list[int], first: Tensor | None) -> list[list[int]]:
    """Greedy tokens after the question (``lead``; or after ``first``'s logits), over a fork
    that evicts nothing (as the answer is fed), until each row's lead-in is decided."""
    from kvgate.cache.fork import fork_cache, grow_capacity
    from kvgate.inference.compress import answer_rows, decode_after

    rows, rule = compressed.batch, lead_in_rule(engine.tokenizer)
    if lead:
        return answer_rows(engine, compressed, [lead] * rows, LEAD_TOKENS, rule,
                           room=LEAD_TOKENS)
    cache = fork_cache(compressed.cache)
    grow_capacity(cache, torch.full((rows,), LEAD_TOKENS))
    mask = compressed.attention_mask
    return decode_after(engine, _Logits(first[:, None]), mask, mask.sum(-1, keepdim=True),
                        cache, LEAD_TOKENS, rule)
