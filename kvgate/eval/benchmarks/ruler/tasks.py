"""RULER-style synthetic tasks, generated offline, exact in length (tokens) and depth.

After RULER (Hsieh et al. 2024, NVIDIA/RULER ``scripts/data/synthetic``), rewritten: each
example is kvpress's form (``context`` / ``question`` / ``answer_prefix`` / ``answers``), the
question is *not* in the context (it is asked after compression), the context has exactly
``length`` tokens of the given tokenizer (no special tokens), and needles sit at the asked
depths (fractions of the haystack). Haystacks: ``noise`` (RULER's repeated sentences),
``essay`` (sentences of BoolQ's Wikipedia passages, which the training corpus excludes) and
``needle`` (distractor needles). ``qa_1`` asks a SciQ question over its support passage among
distractor passages, ``qa_2`` a BoolQ yes/no question over its passage.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvgate.eval.benchmarks.ruler.haystack import (
    RulerError,
    boolq_rows,
    fit_exact,
    haystack_units,
    sciq_rows,
    token_counter,
    vocabulary,
)


@dataclass
class RulerExample:
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    length: int  # tokens of the context
    depths: list[float] = field(default_factory=list)  # of each needle, as asked
    needle_offsets: list[int] = field(default_factory=list)  # character offset of each needle
    needles: list[str] = field(default_factory=list)


# name: (haystack, key kind, value kind, keys, values per key, queried keys)
NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
TASKS = (*NIAH, "vt", "cwe", "fwe", "qa_1", "qa_2")
SCORING = {name: ("string_match_part" if name.startswith("qa") else "string_match_all")
           for name in TASKS}


def _value(kind: str, rng: random.Random, words: tuple[str, ...]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        hexd = "".join(rng.choice("0123456789abcdef") for _ in range(32))
        return "-".join((hexd[:8], hexd[8:12], hexd[12:16], hexd[16:20], hexd[20:]))
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _depths(n: int, depth: float | None, rng: random.Random) -> list[float]:
    if depth is not None:
        if not 0.0 <= depth <= 1.0:
            raise RulerError(f"depth must lie in [0, 1], got {depth}")
        return [depth] * n if n == 1 else sorted([depth] + [rng.random() for _ in range(n - 1)])
    return sorted(rng.random() for _ in range(n))


def _niah(name: str, count, length: int, depth: float | None, rng: random.Random) -> RulerExample:
    hay, kk, vk, n_keys, n_values, n_queries = NIAH[name]
    words = vocabulary()
    keys: list[str] = []
    while len(keys) < n_keys:
        key = _value(kk, rng, words)
        if key not in keys:
            keys.append(key)
    values = [[_value(vk, rng, words) for _ in range(n_values)] for _ in keys]
    noun = {"numbers": "numbers", "uuids": "uuids", "words": "words"}[vk]
    needles = [f"One of the special magic {noun} for {k} is: {v}. " for k, vs in zip(keys, values)
               for v in vs]
    order = list(range(len(needles)))
    rng.shuffle(order)
    needles = [needles[i] for i in order]
    depths = _depths(len(needles), depth, rng)
    prefix = (f"Some special magic {noun} are hidden within the following text. Make sure to "
              f"memorize it. I will quiz you about the {noun} afterwards.\n")
    if hay == "needle":
        pool = [f"One of the special magic {noun} for {_value(kk, rng, words)} is: "
                f"{_value(vk, rng, words)}. " for _ in range(length)]
    else:
        pool = haystack_units(hay, rng, length)
    context, offsets = fit_exact(count, length, prefix, pool, needles, depths)
    asked = keys[:n_queries]
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    answers = [v for k in range(n_queries) for v in values[k]]
    return RulerExample(name, context, f"What are all the special magic {noun} for {query} "
                        "mentioned in the provided text?",
                        f"The special magic {noun} for {query} mentioned in the provided text are",
                        answers, length, depths, offsets, needles)


def _vt(count, length: int, depth: float | None, rng: random.Random) -> RulerExample:
    hops = 4
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i + 1]} = VAR {names[i]}. "
                                                  for i in range(hops)]
    depths = _depths(len(needles), depth, rng)
    prefix = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    context, offsets = fit_exact(count, length, prefix, haystack_units("noise", rng, length),
                                 needles, depths)
    return RulerExample("vt", context, f"Find all variables that are assigned the value {value} "
                        "in the text above.", "According to the chain(s) of variable assignment "
                        f"in the text above, {len(names)} variables are assigned the value "
                        f"{value}, they are:", names, length, depths, offsets, needles)


def _cwe(count, length: int, depth: float | None, rng: random.Random) -> RulerExample:
    words = list(vocabulary())
    rng.shuffle(words)
    common, rare = words[:10], words[10:]
    items: list[str] = []
    for r in range(length // 8 + 1):  # rounds: each common word 3 times, 3 fresh rare words once
        block = common * 3 + [rare[(3 * r + i) % len(rare)] for i in range(3)]
        rng.shuffle(block)
        items += block
    pool = [f"{i + 1}. {w} " for i, w in enumerate(items)]
    prefix = ("Below is a numbered list of words. In these words, some appear more often than "
              "others. Memorize the ones that appear most often.\n")
    context, _ = fit_exact(count, length, prefix, pool, [], [])
    counts = Counter(w for w in context.split() if w.isalpha())
    top = [w for w, _ in counts.most_common(10)]
    return RulerExample("cwe", context, "What are the 10 most common words in the above list?",
                        "Answer: The top 10 words that appear most often in the list are:",
                        top, length)


def _fwe(count, length: int, depth: float | None, rng: random.Random) -> RulerExample:
    alpha = 2.0
    coded = ["".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(200)]
    weights = [1.0 / (k + 1) ** alpha for k in range(len(coded))]
    stream = rng.choices(coded, weights=weights, k=length)
    pool = [w + " " for w in stream]
    prefix = ("Read the following coded text and track the frequency of each coded word. Find "
              "the three most frequently appeared coded words. ")
    context, _ = fit_exact(count, length, prefix, pool, [], [], tail=" ....")
    counts = Counter(w for w in context.split() if w in set(coded))
    top = [w for w, _ in counts.most_common(3)]
    return RulerExample("fwe", context, "Do not provide any explanation. Please ignore the dots "
                        "'....'. What are the three most frequently appeared words in the above "
                        "coded text?", "Answer: According to the coded text above, the three "
                        "most frequently appeared words are:", top, length)


def _qa(name: str, count, length: int, depth: float | None, rng: random.Random) -> RulerExample:
    if name == "qa_1":
        rows = sciq_rows()
        target = rng.choice(rows)
        passage, question, answers = target["support"], target["question"], [target["correct_answer"]]
        others = [r["support"] for r in rows if r is not target]
    else:
        rows = boolq_rows()
        target = rng.choice(rows)
        passage = target["passage"]
        question = target["question"].rstrip("?") + "?"
        answers = ["yes" if target["answer"] else "no"]
        others = [r["passage"] for r in rows if r is not target]
    rng.shuffle(others)
    depths = _depths(1, depth, rng)
    pool = [f"Document:\n{p}\n\n" for p in others]
    prefix = ("Answer the question based on the given documents. Only give me the answer and do "
              "not output any other words.\n\nThe following are given documents.\n\n")
    needle = f"Document:\n{passage}\n\n"
    context, offsets = fit_exact(count, length, prefix, pool, [needle], depths)
    return RulerExample(name, context, "Answer the question based on the given documents. Only "
                        f"give me the answer and do not output any other words.\n\nQuestion: "
                        f"{question}", "Answer:", answers, length, depths, offsets, [needle])


def generate(task: str, tokenizer: Any, length: int, depth: float | None = None,
             seed: int = 0) -> RulerExample:
    """One example of ``task`` whose context has exactly ``length`` tokens; ``depth`` in
    [0, 1] places the (first) needle, None draws every depth at random."""
    if task not in TASKS:
        raise RulerError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if length < 16:
        raise RulerError(f"length must be >= 16 tokens, got {length}")
    rng = random.Random(f"{task}:{length}:{depth}:{seed}")
    count = token_counter(tokenizer)
    if task in NIAH:
        return _niah(task, count, length, depth, rng)
    if task.startswith("qa"):
        return _qa(task, count, length, depth, rng)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[task](count, length, depth, rng)
