"""Token-level work of the lm-eval model: continuation log-likelihoods over a compressed cache,
rolling windows, and batching.

``score_pairs`` scores free (context, continuation) rows with kvgate's own cache-mode scorer
(``kvgate.eval.multiple_choice.score_continuations``, the one behind ``cache_scores``): the
contexts are left padded and prefilled into a ``CompressedCache`` (the policy compresses
them), the continuations are right padded and fed in one forward over the kept entries; lm-eval
also gets whether every continuation token is the greedy choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.eval.errors import model_shape
from kvgate.eval.multiple_choice import score_continuations
from kvgate.inference import Engine


@dataclass
class PairScores:
    """Per row: summed log-probability of the continuation, whether greedy decoding would
    produce it; and over the batch: context entries kept and held by a full cache
    (layers x KV heads x real context tokens)."""

    loglik: list[float]
    greedy: list[bool]
    kept: int
    total: int


def score_pairs(engine: Engine, contexts: Sequence[Sequence[int]],
                continuations: Sequence[Sequence[int]], pad: int = 0) -> PairScores:
    """Score each ``continuations[i]`` after ``contexts[i]`` compressed by ``engine``'s policy
    at its budget (one cache for the batch; every sequence non-empty)."""
    num_layers, kv_heads = model_shape(engine.model)
    rows = score_continuations(engine.model, engine.new_cache(), contexts, continuations, pad,
                               engine.tokenizer)
    return PairScores(rows.loglik.tolist(), rows.greedy.tolist(), int(rows.kept.sum()),
                      num_layers * kv_heads * int(rows.n_real.sum()))


def fit_pair(context: list[int], continuation: list[int], max_length: int
             ) -> tuple[list[int], list[int]]:
    """Cut a pair to ``max_length`` tokens the harness' way: the context loses its oldest
    tokens first; a continuation longer than the limit keeps its last tokens, after the one
    token before them."""
    if len(continuation) >= max_length:  # max_length >= 2 (checked by the model)
        whole = context + continuation
        return whole[-max_length:-max_length + 1], continuation[-(max_length - 1):]
    room = max_length - len(continuation)
    return context[-room:], continuation


def rolling_pairs(tokens: list[int], prefix: int, max_length: int, context: int
                  ) -> list[tuple[list[int], list[int]]]:
    """A text's tokens as disjoint (context, continuation) windows: every token is scored once;
    the first window is scored after ``prefix`` (BOS/EOS), each later one after the
    ``context - 1`` tokens before it (lm-eval's ``get_rolling_token_windows`` with
    ``context_len=context``), which the policy compresses."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(
        tokens, prefix_token=prefix, max_seq_len=max_length, context_len=context)]


def batches(order: Sequence[int], size: int) -> list[list[int]]:
    """``order`` in chunks of ``size``."""
    size = max(1, int(size))
    return [list(order[i:i + size]) for i in range(0, len(order), size)]
