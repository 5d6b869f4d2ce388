"""LongBench's metrics (kvgate.eval.benchmarks.longbench.scoring) on hand-computed cases, the
per-task metric map, the first-line rule, task groups and the middle cut of over-long contexts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvgate.data.longctx import LONGBENCH_E_TASKS, LONGBENCH_TASKS
from kvgate.eval.benchmarks.longbench.run import (
    MAX_NEW_TOKENS,
    middle_truncate,
    task_max_new_tokens,
)
from kvgate.eval.benchmarks.longbench.scoring import (
    TASK_METRIC,
    LongBenchError,
    base_task,
    classification_score,
    code_sim_score,
    count_score,
    first_code_line,
    fuzz_ratio,
    indel_distance,
    levenshtein_ratio,
    normalize_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    score_example,
    task_names,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer


def test_qa_f1_normalises_and_scores_partial_overlap():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    # "eiffel tower paris" vs "eiffel tower": 2 shared, P = 2/3, R = 1, F1 = 0.8
    assert qa_f1_score("The Eiffel Tower, Paris", "Eiffel Tower") == pytest.approx(0.8)
    assert qa_f1_score("an apple", "the Apple.") == 1.0
    assert qa_f1_score("banana", "apple") == 0.0
    assert qa_f1_score("", "apple") == 0.0


def test_qa_f1_zh_counts_characters_without_punctuation():
    # [北, 京, 市] vs [北, 京]: P = 2/3, R = 1
    assert qa_f1_zh_score("北京市", "北京") == pytest.approx(0.8)
    assert qa_f1_zh_score("北京。", " 北 京 ") == 1.0
    assert qa_f1_zh_score("上海", "北京") == 0.0


def test_rouge_l_as_the_rouge_package():
    # distinct words: 5 and 5; the LCS "the cat on the mat" holds 4 distinct words
    assert rouge_score("the cat sat on the mat", "the cat lay on the mat") == \
        pytest.approx(2 * 0.8 * 0.8 / (1.6 + 1e-8))
    # summary level: the LCS of each predicted sentence with the reference, united
    assert rouge_score("a b. c d", "a b c d") == pytest.approx(1.0, abs=1e-7)
    assert rouge_score("x y z", "a b c") == 0.0
    assert rouge_score("", "a b") == 0.0 and rouge_score("...", "a b") == 0.0
    # characters for Chinese: {今,天,气,好} of 5 distinct each side
    assert rouge_zh_score("今天天气很好", "今天天气不好") == pytest.approx(0.8, abs=1e-7)


def test_levenshtein_ratio_and_code_similarity():
    # substitutions cost 2: kitten -> sitting is 5 edits, (6 + 7 - 5) / 13
    assert indel_distance("kitten", "sitting") == 5
    assert levenshtein_ratio("kitten", "sitting") == pytest.approx(8 / 13)
    assert fuzz_ratio("kitten", "sitting") == 62
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0
    pred = "\n```python\n# the next line\nx = foo(1)\ny = 2\n"
    assert first_code_line(pred) == "x = foo(1)"
    assert first_code_line("// only a comment") == ""
    # "x = foo(1)" vs "x = foo(2)": one substitution, (20 - 2) / 20
    assert code_sim_score(pred, "x = foo(2)") == pytest.approx(0.9)


def test_retrieval_and_count():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert retrieval_score("I do not know", "Paragraph 3") == 0.0
    assert retrieval_score("paragraph 13", "Paragraph 3") == 0.0
    assert retrieval_zh_score("答案是段落12", "段落12") == 1.0
    assert count_score("There are 4 unique paragraphs, not 5", "4") == 0.5
    assert count_score("four", "4") == 0.0


def test_classification_follows_longbench():
    classes = ["location", "Other location", "Number"]
    # "location" lies inside the reference "Other location": dropped, one match left
    assert classification_score("Other location", "Other location", classes) == 1.0
    # reference "location": both names match, so half the credit
    assert classification_score("Other location", "location", classes) == 0.5
    assert classification_score("Number", "location", classes) == 0.0
    assert classification_score("Location", "location", classes) == 0.0  # case counts
    # LongBench's loop skips the name after one it drops: "b" stays, so 1/2 (not 1)
    assert classification_score("ab", "ab", ["a", "b", "ab"]) == 0.5
    # without all_classes: the reference inside the prediction
    assert classification_score("Type: Location.", "Location", None) == 1.0
    assert classification_score("Type: Number", "Location", []) == 0.0


def test_score_example_best_reference_first_line_and_percent():
    assert score_example("hotpotqa", "Paris", ["London", "Paris"]) == 100.0
    assert score_example("hotpotqa", "Paris France", ["Paris"]) == pytest.approx(200 / 3)
    # few-shot tasks: the first line only (after leading new lines)
    later = "Paris\nQuestion: and Rome?\nAnswer: Rome"
    assert score_example("triviaqa", later, ["Paris"]) == 100.0
    assert score_example("hotpotqa", later, ["Paris"]) < 100.0
    classes = ["Location", "Number"]
    assert score_example("trec", "\nLocation\nNumber", ["Location"], classes) == 100.0
    assert score_example("trec-e", "Location Number", ["Location"], classes) == 50.0
    assert score_example("passage_count", "3", []) == 0.0


def test_every_task_has_a_metric_and_tokens_to_generate():
    assert set(TASK_METRIC) == set(LONGBENCH_TASKS) == set(MAX_NEW_TOKENS)
    for task in [*LONGBENCH_TASKS, *(f"{t}-e" for t in LONGBENCH_E_TASKS)]:
        assert base_task(task) in TASK_METRIC
        assert 32 <= task_max_new_tokens(task) <= 512
    assert task_max_new_tokens("gov_report", 16) == 16
    assert TASK_METRIC["lcc"] == "code_sim" and TASK_METRIC["vcsum"] == "rouge_zh"
    for bad in ("nope", "dureader-e"):  # dureader has no LongBench-E subset
        with pytest.raises(LongBenchError, match=f"unknown LongBench task '{bad}'") as info:
            base_task(bad)
        assert "\n" not in str(info.value)


def test_task_groups():
    en = task_names(["en"])
    assert len(en) == 16 and "hotpotqa" in en and "lsht" not in en
    assert task_names(["zh"]) == ["multifieldqa_zh", "dureader", "vcsum", "lsht",
                                  "passage_retrieval_zh"]
    assert len(task_names(["all"])) == 21 and len(task_names(["e"])) == 13
    assert task_names(["trec", "e", "trec"])[:2] == ["trec", "qasper-e"]


def test_middle_truncation_keeps_head_and_tail():
    tok = char_tokenizer()
    assert middle_truncate(tok, "abcdefghij", 4) == ("abij", 6)
    assert middle_truncate(tok, "abcdefghij", 5) == ("abhij", 5)
    assert middle_truncate(tok, "abcdefghij", 10) == ("abcdefghij", 0)
    assert middle_truncate(tok, "abcdefghij", None) == ("abcdefghij", 0)
