"""k-shot prompts: demonstrations are solved examples of the same task, never the example itself,
drawn the same way whatever subset is scored."""

import pytest

from kvgate.data import DataError, MCExample, load_task
from kvgate.data.fewshot import DELIMITER, add_fewshot, fewshot_label


def make(task, i, context=None, gold=0):
    return MCExample(task=task, uid=f"{task}:{i}", context=context or f"Q{i}:",
                     choices=[f" a{i}", f" b{i}"], gold=gold)


POOL = [make("toy", i, gold=i % 2) for i in range(40)]


def demos_of(example):
    """The demonstration blocks before the example's own context."""
    return example.context.split(DELIMITER)[:-1]


def test_zero_shots_leave_the_examples_as_they_are():
    assert add_fewshot(POOL[:5], POOL, 0) == POOL[:5]


def test_each_context_gets_k_solved_examples_then_its_own():
    out = add_fewshot(POOL[:10], POOL, 3)
    solved = {f"{d.context}{d.choices[d.gold]}": d for d in POOL}
    for before, after in zip(POOL[:10], out):
        assert (after.uid, after.choices, after.gold) == (before.uid, before.choices, before.gold)
        assert after.context.endswith(DELIMITER + before.context)
        shots = demos_of(after)
        assert len(shots) == 3 and len(set(shots)) == 3
        assert all(s in solved for s in shots)  # context + the gold answer, not another choice
        assert before.context + before.choices[before.gold] not in shots


def test_an_example_never_sees_itself_or_a_repeat_of_its_context():
    # toy:9 repeats toy:0's context, so toy:0 can only be shown the other three
    small = [make("toy", i) for i in range(4)] + [make("toy", 9, context="Q0:")]
    out = add_fewshot(small, small, 3)
    assert sorted(demos_of(out[0])) == ["Q1: a1", "Q2: a2", "Q3: a3"]
    for before, after in zip(small, out):
        assert before.context + before.choices[0] not in demos_of(after)


def test_prompts_do_not_depend_on_which_examples_are_scored():
    whole = add_fewshot(POOL, POOL, 2)
    assert add_fewshot(POOL[7:12], POOL, 2) == whole[7:12]
    assert add_fewshot(POOL[::-1], POOL, 2) == whole[::-1]
    other_seed = add_fewshot(POOL, POOL, 2, seed=1)
    assert sum(a.context != b.context for a, b in zip(whole, other_seed)) > len(POOL) // 2


def test_demonstrations_come_from_the_same_task():
    mixed = POOL + [make("other", i, context=f"O{i}:") for i in range(40)]
    for ex in add_fewshot(POOL, mixed, 4):
        assert len(demos_of(ex)) == 4 and all(s.startswith("Q") for s in demos_of(ex))


def test_a_pool_too_small_is_refused_by_name():
    with pytest.raises(DataError, match="few-shot pool of toy has 2 other examples to draw "
                                        "from, 3 asked"):
        add_fewshot(POOL[:1], POOL[:3], 3)
    for k in (-1, True, 1.5):
        with pytest.raises(DataError, match="num_fewshot must be an integer >= 0"):
            add_fewshot(POOL[:1], POOL, k)


def mmlu(i, subject, gold=0):
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    return MCExample(task="mmlu", uid=f"mmlu:{subject}:{i}",
                     context=f"{head}{subject} question {i}\nA. x\nB. y\nAnswer:",
                     choices=[" A", " B"], gold=gold)


def test_mmlu_states_its_description_once_and_stays_within_the_subject():
    pool = [mmlu(i, s, gold=i % 2) for s in ("anatomy", "virology") for i in range(6)]
    for ex in add_fewshot(pool, pool, 3):
        subject = ex.uid.split(":")[1]
        assert ex.context.startswith(f"The following are multiple choice questions (with "
                                     f"answers) about {subject}.\n\n{subject} question")
        assert ex.context.count("The following are") == 1
        blocks = ex.context.split(DELIMITER)
        assert len(blocks) == 5  # description, three demonstrations, the question
        assert all(b.startswith(f"{subject} question") for b in blocks[1:])
        assert all(b.endswith(("Answer: A", "Answer: B")) for b in blocks[1:4])


def test_an_embedded_task_takes_shots_from_its_own_split():
    copa = load_task("copa")
    out = add_fewshot(copa[:5], copa, 2)
    for before, after in zip(copa[:5], out):
        assert len(demos_of(after)) == 2 and after.context.endswith(before.context)
    assert fewshot_label("copa", 0) == "copa" and fewshot_label("copa", 2) == "copa@2shot"
