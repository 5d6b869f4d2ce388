"""The model's context limit, checked where prompts are encoded.

A prompt longer than the positions a model was trained on does not fail inside torch: RoPE
extrapolates and the model prints fluent garbage, after minutes of compute. So every place
that encodes prompts checks them here first, and either refuses in one line or, when the user
asked for it, keeps the end of the prompt and says how much it dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from kvgate.errors import KVGateError


class InputTooLongError(KVGateError, ValueError):
    """A prompt does not fit the model's context; the message gives both lengths."""


def context_limit(config: Any) -> int | None:
    """Tokens the model can attend over (``max_position_embeddings``), or None if unknown."""
    getter = getattr(config, "get_text_config", None)
    config = getter(decoder=True) if getter is not None else config
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def quiet_length_warning(tokenizer: Any) -> Any:
    """Silence a transformers tokenizer's own "sequence length is longer than the specified
    maximum" warning, since the model's context is checked here instead (the tokenizer's
    ``model_max_length`` is often not the model's): a prompt that does not fit gets one line,
    not two. Returns the tokenizer."""
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(flags, dict):
        flags["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def fit_to_context(token_ids: Sequence[Sequence[int]], limit: int | None, reserve: int = 0,
                   truncate: bool = False, what: str = "prompt",
                   reserved: str = "new tokens") -> list[list[int]]:
    """Check (or cut) each sequence so that it plus ``reserve`` tokens after it (``reserved``
    says what they are: the new tokens, or a question and its answer) fits ``limit``.

    Without ``truncate`` a sequence that does not fit raises ``InputTooLongError``; with it,
    its first tokens are dropped (the end, where the question usually is, stays) and one line
    on stderr says how many.
    """
    rows = [list(ids) for ids in token_ids]
    if limit is None:
        return rows
    room = limit - max(0, int(reserve))
    if room < 1:
        raise InputTooLongError(f"{reserve} {reserved} leave no room for a {what} in the "
                                f"model's {limit:,}-token context")
    too_long = [(i, len(ids)) for i, ids in enumerate(rows) if len(ids) > room]
    if not too_long:
        return rows
    i, n = max(too_long, key=lambda x: x[1])
    if not truncate:
        extra = f" + {reserve} {reserved}" if reserve else ""
        raise InputTooLongError(
            f"{what} {i} has {n:,} tokens{extra}; the model takes at most {limit:,} "
            f"(max_position_embeddings): shorten it or pass --truncate to keep its last {room:,}")
    for j, m in too_long:
        rows[j] = rows[j][m - room:]
        print(f"warning: {what} {j} cut to its last {room:,} of {m:,} tokens "
              f"(dropped {m - room:,} from the start) to fit the model's context",
              file=sys.stderr)
    return rows
