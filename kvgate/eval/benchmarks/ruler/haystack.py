"""Haystacks and exact lengths for the RULER-style generators.

Lengths are in tokens of the tokenizer given (no special tokens). A context is assembled from
haystack units (sentences, list items) with needles inserted between units at the asked
depths; the number of units is searched so that the text fits, and the last unit is cut
character by character to reach the length exactly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from kvgate.errors import KVGateError

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again. ")


class RulerError(KVGateError, ValueError):
    """A RULER task that cannot be built as asked (length, depth, task name)."""


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Tokens of a text without special tokens."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return count


@lru_cache(maxsize=1)
def boolq_rows() -> tuple[dict[str, Any], ...]:
    from kvgate.data import embedded

    return tuple(embedded.rows(embedded.read_hf_columns("boolq/none/validation")))


@lru_cache(maxsize=1)
def sciq_rows() -> tuple[dict[str, Any], ...]:
    from kvgate.data import embedded

    rows = embedded.rows(embedded.read_hf_columns("sciq/none/validation"))
    return tuple(r for r in rows if len(r["support"].split()) >= 20)


@lru_cache(maxsize=1)
def passage_sentences() -> tuple[str, ...]:
    """Sentences of the BoolQ passages (Wikipedia), the essay-like haystack."""
    out = []
    for row in boolq_rows():
        out.extend(s.strip() + " " for s in re.split(r"(?<=[.!?])\s+", row["passage"])
                   if len(s.split()) >= 4)
    return tuple(out)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain lower-case words (4 to 10 letters) of the passages: keys and list words."""
    seen = dict.fromkeys(w for s in passage_sentences() for w in re.findall(r"\b[a-z]{4,10}\b", s))
    return tuple(seen)


def haystack_units(kind: str, rng: random.Random, count: int) -> list[str]:
    """``count`` units of a ``noise`` or ``essay`` haystack."""
    if kind == "noise":
        return [NOISE] * count
    sentences = passage_sentences()
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(count)]


def assemble(prefix: str, units: Sequence[str], needles: Sequence[str],
             depths: Sequence[float], cut: str = "") -> tuple[str, list[int]]:
    """``prefix`` + units with each needle put at the unit boundary nearest ``depth`` of them +
    ``cut`` (a partial unit). Returns the text and each needle's character offset."""
    ends, total = [0], 0
    for u in units:
        total += len(u)
        ends.append(total)
    slots: dict[int, list[int]] = {}
    for i, d in enumerate(depths):  # the unit boundary nearest to the depth, in characters
        j = min(range(len(ends)), key=lambda b: abs(ends[b] - d * total))
        slots.setdefault(j, []).append(i)
    parts, offsets = [prefix], [0] * len(needles)
    size = len(prefix)
    for j in range(len(units) + 1):
        for i in slots.get(j, []):
            offsets[i] = size
            parts.append(needles[i])
            size += len(needles[i])
        if j < len(units):
            parts.append(units[j])
            size += len(units[j])
    parts.append(cut)
    return "".join(parts), offsets


def fit_exact(count: Callable[[str], int], length: int, prefix: str, pool: Sequence[str],
              needles: Sequence[str], depths: Sequence[float], tail: str = NOISE,
              ) -> tuple[str, list[int]]:
    """The context of exactly ``length`` tokens: as many units of ``pool`` as fit, then the
    next unit (and ``tail`` after it) cut character by character to close the gap."""
    def fits(k: int) -> bool:
        return count(assemble(prefix, pool[:k], needles, depths)[0]) <= length

    if not fits(0):
        raise RulerError(f"needles and instructions alone exceed {length} tokens")
    lo, hi = 0, 1
    while hi <= len(pool) and fits(hi):  # grow first: never tokenise far past the length
        lo, hi = hi, hi * 2
    hi = min(hi, len(pool) + 1)
    while hi - lo > 1:  # largest unit count that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    filler = "".join(pool[lo:lo + 1]) + tail * 8
    for end in range(len(filler) + 1):  # characters of one unit: a loop over text, not tokens
        body, offsets = assemble(prefix, pool[:lo], needles, depths, filler[:end])
        n = count(body)
        if n == length:
            return body, offsets
        if n > length + 1:
            break
    if lo == len(pool):
        raise RulerError(f"the haystack is too short for {length} tokens")
    raise RulerError(f"could not reach exactly {length} tokens with this tokenizer")
