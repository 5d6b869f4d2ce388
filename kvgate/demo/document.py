"""The demo's default document: about 2,000 tokens of Wikipedia passages with three facts
placed at different depths, each with the question that asks for it.

The passages are BoolQ's (validation split, shipped with the embedded data). BoolQ is one of
the evaluation tasks, and the training corpus drops every document that shares a 13-word run
with an evaluation text (``kvgate.data.corpus``), so no gate trained here has seen this
document. The facts are invented: the model cannot answer them from what it learned in
pre-training, only from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.errors import KVGateError


class DemoError(KVGateError, ValueError):
    """A demo that cannot run as asked (a document too short, a bad option)."""


@dataclass(frozen=True)
class Fact:
    """One sentence placed in the document, the question that asks for it and its answer."""

    sentence: str
    question: str
    answer: str
    depth: float  # where it goes, as a share of the document (0 = start, 1 = end)


# one name, one number, one phrase, at the start, the middle and the end of the document
FACTS = (
    Fact("The bakery on Mill Street was founded by a woman named Clara Voss.",
         "Who founded the bakery on Mill Street?", "Clara Voss", 0.15),
    Fact("The old harbour lighthouse was first lit in the year 1847.",
         "In what year was the old harbour lighthouse first lit?", "1847", 0.5),
    Fact("The password to the museum's map room is silver heron.",
         "What is the password to the museum's map room?", "silver heron", 0.85),
)


def _passages() -> tuple[str, ...]:
    # the RULER generator's reader of the same embedded file (one reader, cached)
    from kvgate.eval.benchmarks.ruler.haystack import boolq_rows

    return tuple(" ".join(r["passage"].split()) for r in boolq_rows())


def demo_document(tokenizer: Any, tokens: int = 2000, facts: Sequence[Fact] = FACTS,
                  start: int = 0) -> str:
    """Whole passages from ``start`` on, one paragraph each, up to ``tokens`` tokens,
    with each fact added to the end of the paragraph nearest its depth (in tokens)."""
    if tokens < 64:
        raise DemoError(f"a demo document of {tokens} tokens is too short (at least 64)")
    passages = _passages()
    paragraphs: list[str] = []
    sizes: list[int] = []
    fact_tokens = sum(len(tokenizer(f.sentence, add_special_tokens=False)["input_ids"])
                      for f in facts)
    for text in passages[start:] + passages[:start]:
        size = len(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if sum(sizes) + size + fact_tokens > tokens:
            break
        paragraphs.append(text)
        sizes.append(size)
    if not paragraphs:
        raise DemoError(f"a demo document of {tokens} tokens holds no whole passage beside its "
                        f"facts ({fact_tokens} tokens): ask for more tokens")
    total = sum(sizes)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    for fact in facts:
        # the paragraph whose end lies nearest the fact's depth
        i = min(range(len(ends)), key=lambda j: abs(ends[j] - fact.depth * total))
        paragraphs[i] = f"{paragraphs[i]} {fact.sentence}"
    return "\n\n".join(paragraphs)
