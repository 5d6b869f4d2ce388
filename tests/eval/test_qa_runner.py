"""The question-answering runner (``kvgate.eval.runner``): the records it stores for RULER
and the needle equal those stored before it existed (``data/qa_records.json``); teacher
scoring's greedy-exact is greedy generation starting with the gold answer (after its
formatting lead-in)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, tiny_llama_config
from eval_fakes import CharTokenizer
from qa_records import SNAPSHOT, records

from kvgate.eval.asked import Question, ask_agnostic, ask_query_aware, ask_shared
from kvgate.eval.teacher import answer_tokens, formatting_lead_in
from kvgate.policies import Budget, get_policy


def test_ruler_and_needle_records_equal_the_records_before_the_runner(tmp_path):
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(records(tmp_path)))  # as the store writes it
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


@pytest.mark.parametrize("policy", ["full", "snapkv"])
def test_greedy_exact_is_greedy_generation_starting_with_the_gold_answer(policy):
    """Teacher scoring feeds a gold answer once; greedy-exact must say exactly whether greedy
    decoding after the question begins with it: gold answers cut from the generation are
    exact, the same with one token changed (at its start or end) are not."""
    model = build(tiny_llama_config(max_position_embeddings=640))
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(3)
    context = tuple(torch.randint(3, 128, (80,), generator=g).tolist())
    question = tuple(torch.randint(3, 128, (6,), generator=g).tolist())
    pol, budget = get_policy(policy), Budget(ratio=0.5)
    for ask in (ask_agnostic, ask_query_aware):
        made = ask(model, tok, context, Question(question, 6), pol, budget,
                   ["generate"])
        generated = tok(made.text, add_special_tokens=False)["input_ids"]
        assert len(generated) == 6
        other = [3 + (t - 3 + 1) % 125 for t in generated]
        golds = [tuple(generated[:k]) for k in (1, 3, 6)] + [
            (other[0], *generated[1:3]), (*generated[:2], other[2])]
        asked = ask(model, tok, context, Question(question, 6, tuple(golds)), pol, budget,
                    ["generate", "teacher"])
        assert asked.text == made.text and asked.kept == made.kept
        assert [t.exact for t in asked.teacher] == [True, True, True, False, False]
        assert all(t.ll < 0 for t in asked.teacher)
        assert asked.teacher[0].ll > asked.teacher[3].ll  # the argmax beats another token


@pytest.mark.parametrize("text,final,want", [
    (":\n\n1. 5432133", False, 6), ("- 3022203", False, 2), ("5432133", False, 0),
    ("1", False, None), ("1.", False, None), (":\n\n1. ", False, None), ("195", False, 0),
    ("12", True, 0), ("\n\n", True, 2), ("12. x", False, 4), (" Cancer", False, 1)])
def test_formatting_lead_in_is_decided_only_once_the_text_leaves_it(text, final, want):
    assert formatting_lead_in(text, final) == want


@pytest.mark.parametrize("policy", ["full", "snapkv"])
def test_greedy_exact_reads_the_gold_answer_after_the_greedy_lead_in(policy):
    """Where greedy generation opens with formatting (here a new line or a tab), greedy-exact
    must say whether the generation continues with the gold answer after that lead-in, both
    when the lead-in is read from the generation and when teacher scoring decodes it alone."""
    model = build(tiny_llama_config(max_position_embeddings=640))
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(11)  # a seed whose generations open with formatting
    context = tuple(torch.randint(3, 128, (80,), generator=g).tolist())
    question = tuple(torch.randint(3, 128, (6,), generator=g).tolist())
    pol, budget = get_policy(policy), Budget(ratio=0.5)
    for ask in (ask_agnostic, ask_query_aware):
        made = ask(model, tok, context, Question(question, 10), pol, budget, ["generate"])
        end = formatting_lead_in(made.text, final=True)
        assert end >= 1
        rest = made.text[end:]
        other = [chr(32 + (ord(c) - 31) % 90) for c in rest[:3]]
        texts = (rest[:1], rest[:3], rest[:5], other[0] + rest[1:3], rest[:2] + other[2])
        gold = tuple(answer_tokens(tok, "?", t) for t in texts)  # as right after a question
        for scores in (["generate", "teacher"], ["teacher"]):
            asked = ask(model, tok, context, Question(question, 10, gold, texts), pol, budget,
                        scores)
            assert [t.exact for t in asked.teacher] == [True, True, True, False, False]
            assert all(tok.decode(list(t.lead)) == made.text[:end] for t in asked.teacher)
            assert asked.teacher[0].tokens == tuple(tok(rest[:1], False)["input_ids"])


def test_teacher_scoring_of_shared_variants_equals_each_alone():
    """Teacher scoring alone answers every variant of a shared prefill as one batch, a
    decode-evicting policy (H2O) among them: the same scores as each variant asked alone."""
    model = build(tiny_llama_config(max_position_embeddings=640))
    tok = CharTokenizer()
    g = torch.Generator().manual_seed(11)
    context = tuple(torch.randint(3, 128, (80,), generator=g).tolist())
    question = tuple(torch.randint(3, 128, (6,), generator=g).tolist())
    texts = ("ab", "\tc")
    q = Question(question, 10, tuple(answer_tokens(tok, "?", t) for t in texts), texts)
    variants = {"full": (get_policy("full"), Budget(ratio=1.0)),
                "h2o": (get_policy("h2o"), Budget(ratio=0.5)),
                "snapkv": (get_policy("snapkv"), Budget(ratio=0.5))}
    shared = ask_shared(model, tok, context, q, variants, ["teacher"])
    for name, (pol, bud) in variants.items():
        alone = ask_agnostic(model, tok, context, q, pol, bud, ["teacher"])
        for a, b in zip(shared[name].teacher, alone.teacher):
            assert (a.exact, a.tokens, a.lead) == (b.exact, b.tokens, b.lead), name
            assert a.ll == pytest.approx(b.ll, abs=1e-4), name
