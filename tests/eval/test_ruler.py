"""RULER-style generators: exact token length, needles at the asked depths, answers in the
context; RULER's scorers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

from kvgate.eval.benchmarks.ruler import (
    SCORING,
    TASKS,
    RulerError,
    generate,
    score,
    string_match_all,
    string_match_part,
)

TOK = char_tokenizer()


def n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [600, 1500])
def test_exact_length_answers_and_depth(task, length):
    ex = generate(task, TOK, length, depth=0.5, seed=3)
    assert n_tokens(TOK, ex.context) == length == ex.length
    if task == "qa_2":  # yes / no: the passage is what must be in the context
        assert ex.answers in (["yes"], ["no"]) and ex.needles[0] in ex.context
    else:
        assert ex.answers and all(a in ex.context for a in ex.answers)
    assert ex.question and ex.question not in ex.context and ex.answer_prefix
    for needle, offset in zip(ex.needles, ex.needle_offsets):
        assert ex.context[offset:offset + len(needle)] == needle
    if task.startswith(("niah_single", "niah_multikey_2")):
        depth = n_tokens(TOK, ex.context[:ex.needle_offsets[0]]) / length
        assert abs(depth - 0.5) < 0.1


@pytest.mark.parametrize("depth", [0.0, 0.25, 1.0])
def test_needle_depths(depth):
    ex = generate("niah_single_1", TOK, 2000, depth=depth, seed=0)
    at = n_tokens(TOK, ex.context[:ex.needle_offsets[0]]) / 2000
    assert abs(at - depth) < 0.08  # one noise unit of granularity
    assert ex.needles[0].startswith("One of the special magic numbers for")


def test_generation_is_deterministic_and_seeded():
    a = generate("niah_multiquery", TOK, 800, seed=1)
    assert a == generate("niah_multiquery", TOK, 800, seed=1)
    assert a.answers != generate("niah_multiquery", TOK, 800, seed=2).answers
    assert len(a.answers) == 4 and len(a.needles) == 4


def test_family_specifics():
    vt = generate("vt", TOK, 800, seed=0)
    assert len(vt.answers) == 5 and all(f"VAR {v} =" in vt.context for v in vt.answers)
    cwe = generate("cwe", TOK, 1500, seed=0)
    words = [w for w in cwe.context.split() if w.isalpha()]
    rest = max(words.count(w) for w in set(words) - set(cwe.answers))
    assert len(cwe.answers) == 10 and all(words.count(a) > rest for a in cwe.answers)
    mv = generate("niah_multivalue", TOK, 800, seed=0)
    assert len(mv.answers) == 4
    qa = generate("qa_2", TOK, 1500, seed=0)
    assert qa.answers in (["yes"], ["no"])


def test_errors():
    with pytest.raises(RulerError, match="unknown RULER task"):
        generate("niah", TOK, 1000)
    with pytest.raises(RulerError, match="exceed"):
        generate("niah_multiquery", TOK, 100)
    with pytest.raises(RulerError, match="depth"):
        generate("niah_single_1", TOK, 1000, depth=1.5)


@pytest.mark.slow
def test_exact_length_with_smollm2_tokenizer():
    from kvgate.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    for task in ("niah_single_2", "niah_multikey_3", "vt", "fwe", "qa_1"):
        ex = generate(task, tok, 1024, depth=0.3, seed=0)
        assert n_tokens(tok, ex.context) == 1024
        assert all(a in ex.context for a in ex.answers)


def test_string_match_all_gives_partial_credit_per_value():
    refs = [["1234567", "7654321"], ["abc"]]
    assert string_match_all(["1234567 and 7654321", "ABC"], refs) == 100.0
    assert string_match_all(["only 1234567", "nothing"], refs) == 25.0
    assert score("niah_multivalue", ["x 7654321"], [refs[0]]) == 50.0
    assert score("vt", ["A B C"], [["A", "B", "C", "D"]]) == 75.0
    assert score("cwe", ["w1 w2"], [["w1", "w2", "w3", "w4"]]) == 50.0
    assert score("fwe", ["aaa, bbb, ccc"], [["aaa", "bbb", "ccc"]]) == 100.0


def test_string_match_part_needs_any_reference():
    assert string_match_part(["It is Paris."], [["paris", "France"]]) == 100.0
    assert score("qa_1", ["the respiratory system", "no idea"],
                 [["respiratory system"], ["yes"]]) == 50.0
    assert score("qa_2", ["Yes."], [["yes"]]) == 100.0
    assert SCORING["qa_1"] == "string_match_part" and SCORING["niah_single_1"] == "string_match_all"
    with pytest.raises(RulerError):
        string_match_all([], [])
