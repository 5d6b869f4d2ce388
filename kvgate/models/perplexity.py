"""Token-weighted perplexity of a causal LM over a list of texts (no eviction: the base model).

Each text is tokenised on its own, cut to ``max_length`` tokens (no sliding window), and
every token after the first is predicted from its prefix inside that text. The result is
``exp(total NLL / total predicted tokens)`` over all texts, so long texts weigh more, and
it does not depend on how texts are batched: batches are right-padded and the padding is
masked out of both attention and loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvgate.attention.masks import right_pad
from kvgate.errors import KVGateError

# Plain English for sanity checks (conversion, demo fallback, tests); written for kvgate.
SAMPLE_PASSAGES = (
    ("The library opens at nine in the morning and closes at six in the evening. On weekends "
     "it stays open until noon, and many students come early to find a quiet table near the "
     "windows. The librarians are happy to help anyone who is looking for a book."),
    ("Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
     "pressure is lower, so water boils at a lower temperature, and food takes longer to "
     "cook. This is why some recipes give different cooking times for mountain regions."),
    ("After the long winter, the farmers began to plant their fields. They sowed wheat in the "
     "north and corn in the south, hoping for enough rain in the spring. By the end of the "
     "summer, the harvest was better than anyone had expected."),
    ("A computer program is a list of instructions that tells a computer what to do. "
     "Programmers write these instructions in a programming language, and the computer "
     "follows them one step at a time to solve a problem or complete a task."),
)


class PerplexityError(KVGateError, ValueError):
    """Nothing to score (no text with at least two tokens) or a bad argument."""


def _token_ids(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[list[int]]:
    ids = [list(tokenizer(text)["input_ids"])[:max_length] for text in texts]
    return [seq for seq in ids if len(seq) >= 2]


@torch.no_grad()
def sequence_nll(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL and number of predicted tokens of a right-padded batch.

    ids, mask: ``[B, T]``; position t predicts t+1 where both are real tokens.
    """
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # [B, T-1, V]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # [B, T-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll.item(), int((targets != -100).sum())


def perplexity(model: Any, tokenizer: Any, texts: Sequence[str], max_length: int = 512,
               batch_size: int = 4) -> float:
    """Token-weighted perplexity of ``model`` on ``texts`` (see the module docstring).

    ``tokenizer(text)["input_ids"]`` must give the token ids of one text.
    """
    if isinstance(texts, str):
        raise PerplexityError("texts must be a list of strings, not one string")
    if max_length < 2 or batch_size < 1:
        raise PerplexityError(f"need max_length >= 2 and batch_size >= 1, "
                              f"got {max_length} and {batch_size}")
    sequences = sorted(_token_ids(tokenizer, texts, max_length), key=len)  # less padding
    if not sequences:
        raise PerplexityError("no text has the two tokens needed to score one prediction")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    try:
        for start in range(0, len(sequences), batch_size):
            ids, mask = right_pad(sequences[start: start + batch_size], 0)
            nll, count = sequence_nll(model, ids.to(device), mask.to(device))
            total_nll += nll
            total_tokens += count
    finally:
        model.train(was_training)
    return math.exp(total_nll / total_tokens)
