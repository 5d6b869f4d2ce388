"""Compress one document once per policy, ask the same questions after compression, and
tabulate what each policy kept and answered.

The learned gate runs first, at its own threshold; the heuristics then keep the share of the
context the gate kept (``Budget`` of that ratio per KV head), so every row holds about the same
number of entries and only where they come from differs. The policies never see a question:
each question is answered over its own fork of the compressed cache
(``kvgate.inference.compress``), as kvpress and RULER evaluate eviction.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgate.policies import get_policy
from kvgate.policies.base import Budget

GATE = "gate"  # the name that stands for the checkpoint's own gate policy


@dataclass
class DemoRow:
    """One policy's result on the document."""

    policy: str  # as shown: "full cache", "learned gate (local_gate)", "tova", ...
    kept_fraction: float  # share of the context's (token, KV head) entries kept
    bytes_held: int  # what the compressed cache holds (K/V and positions)
    bytes_full: int  # the dense cache of the same context
    answers: list[str] = field(default_factory=list)
    holds: list[bool | None] = field(default_factory=list)  # None: no answer given to check
    seconds: float = 0.0  # compress + answers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def holds_fact(answer: str, gold: str) -> bool:
    """Whether ``answer`` states ``gold``: its words, in order, after lower-casing and dropping
    punctuation (so "Tobias Wren." and "It was Tobias Wren" hold "Tobias Wren")."""
    a, g = f" {_normal(answer)} ", f" {_normal(gold)} "
    return bool(g.strip()) and g in a


def run_demo(model: Any, tokenizer: Any, context: str, questions: Sequence[str],
             gold: Sequence[str | None] | None = None, gate_policy: str | None = None,
             policies: Sequence[str] = ("full", GATE, "tova", "snapkv"),
             max_new_tokens: int = 24, say: Callable[[str], None] | None = None,
             ) -> list[DemoRow]:
    """Each of ``policies`` compresses ``context`` once and answers every question.

    ``GATE`` stands for ``gate_policy`` (the gated model's policy, e.g. ``local_gate``) and
    runs first: the other budgeted policies keep its kept share. Without a gate among them
    they keep half the context. ``full`` keeps everything. ``gold[i]``, when given, is checked
    in answer ``i`` (``holds_fact``)."""
    from kvgate.inference import Engine

    gold = list(gold) if gold is not None else [None] * len(questions)
    names = list(policies)
    if GATE in names:  # the gate first: its kept share is the others' budget
        names.remove(GATE)
        names.insert(0, GATE)
    share, rows = 0.5, {}
    for name in names:
        real = gate_policy if name == GATE else name
        policy = get_policy(real)
        budget = Budget.parse(1.0 if policy.budget_free else round(share, 4))
        t0 = time.perf_counter()
        engine = Engine(model, tokenizer, policy, budget)
        compressed = engine.compress(context)
        answers = [a.strip() for a in engine.answer(compressed, list(questions), max_new_tokens)]
        label = ("full cache" if real == "full" else
                 f"learned gate ({real})" if name == GATE else real)
        rows[name] = DemoRow(label, compressed.kept_fraction, compressed.bytes_held,
                             compressed.bytes_full, answers,
                             [None if g is None else holds_fact(a, g)
                              for a, g in zip(answers, gold)],
                             time.perf_counter() - t0)
        if name == GATE:
            share = compressed.kept_fraction
        if say is not None:
            say(f"{label}: kept {100 * compressed.kept_fraction:.1f}%, "
                f"{rows[name].seconds:.1f} s")
    return [rows[name] for name in policies]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def gist(answer: str, question: str) -> str:
    """``answer`` without its opening words that only repeat the question ("The password to
    the map room is silver heron." -> "silver heron."): a small model restates the question
    first, and a table cell has room for the rest only."""
    asked = set(_normal(question).split())
    words = answer.split()
    lead = 0
    # "museum's" is the words "museum" and "s": repeated when every part was asked
    while lead < len(words) - 1 and set(_normal(words[lead]).split()) <= asked:
        lead += 1
    return " ".join(words[lead:])


def _cell(text: str, width: int) -> str:
    """The first sentence of ``text``, its end kept when too long: an answer's fact comes
    last ("... a woman named Clara Voss.")."""
    text = " ".join(text.split())
    text = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    return text if len(text) <= width else "..." + text[-(width - 3):]


def demo_table(rows: Sequence[DemoRow], questions: Sequence[str],
               gold: Sequence[str | None] | None = None, width: int = 28,
               marks: tuple[str, str] = ("✓", "✗")) -> str:
    """The questions, then one markdown table: per policy the kept share, the KV bytes held
    against the dense cache, each answer (its ``gist``'s first sentence, its end when longer
    than ``width``) marked by whether it holds the fact, and the facts held."""
    gold = list(gold) if gold is not None else [None] * len(questions)
    lines = [f"Q{i + 1}: {q}" + (f"  (fact: {g})" if g else "")
             for i, (q, g) in enumerate(zip(questions, gold))]
    head = ["policy", "kept", "KV bytes held"] + [f"Q{i + 1}" for i in range(len(questions))]
    checked = any(g is not None for g in gold)
    if checked:
        head.append("facts held")
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.policy, f"{100 * r.kept_fraction:.1f}%",
                 f"{_mib(r.bytes_held)} of {_mib(r.bytes_full)}"]
        for answer, ok, question in zip(r.answers, r.holds, questions):
            mark = "" if ok is None else (marks[0] if ok else marks[1]) + " "
            cells.append(mark + _cell(gist(answer, question), width).replace("|", "/"))
        if checked:
            cells.append(f"{sum(bool(h) for h in r.holds)}/{sum(h is not None for h in r.holds)}")
        lines.append("| " + " | ".join(cells) + " |")
    note = ("KV bytes held: the kept K/V and each entry's position (so the full cache holds a "
            "little more than the dense one), against the dense cache of the context.")
    lines += ["", note]
    return "\n".join(lines)
