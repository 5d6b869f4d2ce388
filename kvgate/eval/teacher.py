"""Answers scored in one forward (``--score teacher``): after the question, each gold answer's
tokens are fed once over a fork of the compressed cache, and every position's logits give

- the answer's mean log-likelihood per token, and
- *greedy-exact*: every gold token is the argmax at its position, which is exactly when greedy
  decoding right after the question would begin with the gold answer.

One forward per gold answer instead of a decode step per generated token. The answer's tokens
adds to the cache and evicts nothing (as the question does), so for a policy that evicts while
decoding (H2O, TOVA, ...) greedy-exact can differ from what its decoding would give on long
answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from kvgate.eval.errors import EvalError, model_device


@dataclass(frozen=True)
class TeacherScore:
    ll: float  # mean log-likelihood per answer token
    exact: bool  # every answer token is the argmax at its position
    tokens: tuple[int, ...]

    def record(self) -> dict:
        return {**asdict(self), "tokens": list(self.tokens)}


@torch.no_grad()
def teacher_scores(model: nn.Module, compressed, lead: Sequence[int],
                   answers: Sequence[Sequence[int]], first: Tensor | None = None,
                   ) -> list[list[TeacherScore]]:
    """Per row of ``compressed`` (a ``CompressedContext``), a score per answer: ``lead`` (the
    question's tokens, the same for every row) and the answer are fed over a fork of the cache.
    ``first`` [B, V]: the logits that predict the answer's first token when ``lead`` is empty
    (those of the forward that filled the cache)."""
    from kvgate.cache.fork import fork_cache, grow_capacity

    if not answers or any(not a for a in answers):
        raise EvalError("teacher scoring needs at least one gold answer, each with tokens")
    if not lead and first is None:
        raise EvalError("teacher scoring needs the question's tokens or the logits before them")
    device = model_device(model)
    rows = compressed.batch
    start = compressed.attention_mask.sum(-1).to(device)
    out: list[list[TeacherScore]] = [[] for _ in range(rows)]
    for answer in answers:  # a forward per gold answer
        seq = list(lead) + list(answer[:-1])
        parts = [] if first is None else [first.float()[:, None]]
        if seq:
            cache = fork_cache(compressed.cache)
            grow_capacity(cache, torch.full((rows,), len(seq)))
            ids = torch.tensor([seq] * rows, device=device)
            mask = torch.cat([compressed.attention_mask.to(device), torch.ones_like(ids)], dim=1)
            pos = start[:, None] + torch.arange(len(seq), device=device)
            parts.append(model(input_ids=ids, attention_mask=mask, position_ids=pos,
                               past_key_values=cache, use_cache=True).logits.float())
        logits = torch.cat(parts, dim=1)[:, -len(answer):]  # [B, A, V]: predicts token a
        gold = torch.tensor(list(answer), device=device).expand(rows, -1)
        logp = logits.gather(-1, gold[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
        exact = (logits.argmax(-1) == gold).all(-1)
        for b in range(rows):
            out[b].append(TeacherScore(float(logp[b].double().mean()), bool(exact[b]),
                                       tuple(answer)))
    return out


def answer_tokens(tokenizer, prompt_end: str, answer: str) -> tuple[int, ...]:
    """The tokens greedy decoding would write for ``answer`` after a prompt ending in
    ``prompt_end``: a space first unless the prompt ends in white space (an answer prefix such
    as "... is" is followed by " 42"; a chat template's generation prompt ends in a new line)."""
    lead = "" if not prompt_end or prompt_end[-1].isspace() else " "
    return tuple(tokenizer(lead + answer, add_special_tokens=False)["input_ids"])
