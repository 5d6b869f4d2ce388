"""SFT train/test parts: disjoint, complete, deterministic, seeded."""

from __future__ import annotations

from functools import cache

import pytest

from kvgate.data import TASKS, DataError, load_sft_split, load_task, split_examples
from kvgate.data.splits import split_key


@cache
def _task(task: str):
    return load_task(task)


@pytest.mark.parametrize("task", TASKS)
def test_parts_are_disjoint_and_complete(task):
    everything = _task(task)
    train, test = split_examples(everything, "train"), split_examples(everything, "test")
    assert len(train) + len(test) == len(everything)
    assert {e.uid for e in train} | {e.uid for e in test} == {e.uid for e in everything}
    assert not {e.uid for e in train} & {e.uid for e in test}
    assert not {e.context for e in train} & {e.context for e in test}
    assert not {split_key(e) for e in train} & {split_key(e) for e in test}
    assert train and test
    assert abs(len(test) / len(everything) - 0.3) < (0.03 if len(everything) > 1000 else 0.1)


def test_load_sft_split_is_the_hash_split_of_validation():
    for part in ("train", "test"):
        assert load_sft_split("rte", part) == split_examples(_task("rte"), part)
        assert load_sft_split("rte", part, 0.5, 3) == split_examples(_task("rte"), part, 0.5, 3)


def test_shared_passages_stay_together():
    # BoolQ asks several questions about one passage: all of them fall in one part
    examples = _task("boolq")
    by_passage: dict[str, int] = {}
    for e in examples:
        by_passage[split_key(e)] = by_passage.get(split_key(e), 0) + 1
    assert any(n > 1 for n in by_passage.values())
    train = {split_key(e) for e in split_examples(examples, "train")}
    assert not train & {split_key(e) for e in split_examples(examples, "test")}


def test_other_fractions():
    examples = _task("hellaswag")
    small = split_examples(examples, "test", test_fraction=0.1)
    assert abs(len(small) / len(examples) - 0.1) < 0.02
    # a smaller test part is a subset of a larger one under the same seed
    assert {e.uid for e in small} <= {e.uid for e in split_examples(examples, "test")}


def test_deterministic_and_seeded():
    examples = _task("piqa")
    first = [e.uid for e in split_examples(examples, "test", seed=0)]
    assert first == [e.uid for e in split_examples(list(examples), "test", seed=0)]
    other = [e.uid for e in split_examples(examples, "test", seed=1)]
    assert set(first) != set(other)


def test_membership_does_not_depend_on_order_or_subset():
    examples = _task("arc_easy")
    test_uids = {e.uid for e in split_examples(examples, "test")}
    reversed_part = split_examples(examples[::-1][:200], "test")
    assert reversed_part and {e.uid for e in reversed_part} <= test_uids


@pytest.mark.parametrize("kwargs,pattern", [
    ({"part": "dev"}, "part must be"),
    ({"part": "train", "test_fraction": 1.0}, "test_fraction"),
    ({"part": "train", "test_fraction": 0}, "test_fraction"),
    ({"part": "train", "source": "ftp"}, "source must be"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(DataError, match=pattern):
        load_sft_split("copa", **kwargs)
