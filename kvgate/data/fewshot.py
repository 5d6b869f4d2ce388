"""k-shot prompts: solved examples of the same task placed before each example's context.

A demonstration is an example's context followed by its gold choice; ``k`` of them, then the
example's own context, joined by a blank line (lm-evaluation-harness' default
``fewshot_delimiter``). Choices, gold and uid stay the example's own: only the context grows.

Demonstrations are drawn per example from a pool (the task's other examples of some split),
never the example itself nor one with the same context, by a generator seeded with ``seed`` and
the example's uid. So an example gets the same prompt whatever ``--limit`` or order it is
scored in, and a resumed run rebuilds the prompts it stored. The harness draws from one shared
generator instead, so its demonstrations differ from these (the accuracies are comparable in
kind, not to the digit).

MMLU: the description line ("The following are multiple choice questions (with answers)
about {subject}.") is said once, at the top, and the demonstrations come from the same subject,
as in the harness' 5-shot MMLU (it draws them from the dev split: ``--fewshot-split dev``).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from kvgate.data.errors import DataError
from kvgate.data.tasks import MCExample

DELIMITER = "\n\n"
_MMLU_DESCRIPTION = re.compile(r"The following are multiple choice questions \(with answers\)"
                               r"[^\n]*\.\n\n")


def _description(example: MCExample) -> str:
    """The task description that heads ``example``'s context ("" where the task has none)."""
    if example.task != "mmlu":
        return ""
    found = _MMLU_DESCRIPTION.match(example.context)
    return found.group(0) if found else ""


def fewshot_label(task: str, k: int) -> str:
    """The task name results are stored under: ``piqa`` at zero shots, ``piqa@3shot`` else,
    so zero- and k-shot scores of one task never share a key."""
    return task if k == 0 else f"{task}@{k}shot"


def add_fewshot(examples: Sequence[MCExample], pool: Sequence[MCExample], k: int,
                seed: int = 0, delimiter: str = DELIMITER) -> list[MCExample]:
    """``examples`` with ``k`` demonstrations from ``pool`` before each context (see the module
    docstring); ``k = 0`` returns them unchanged."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise DataError(f"num_fewshot must be an integer >= 0, got {k!r}")
    if k == 0:
        return list(examples)
    groups: dict[tuple[str, str], list[MCExample]] = defaultdict(list)
    for demo in pool:
        groups[demo.task, _description(demo)].append(demo)
    out = []
    for ex in examples:
        head = _description(ex)
        candidates = groups.get((ex.task, head), [])
        rng = random.Random(f"{seed}|{ex.uid}")
        # k + 1 draws leave k once the example itself drops out; where a repeat of its context
        # dropped out too, the whole pool in a random order
        demos: list[MCExample] = []
        for draw in (min(len(candidates), k + 1), len(candidates)):
            picked = [candidates[i] for i in rng.sample(range(len(candidates)), draw)]
            demos = [d for d in picked if d.uid != ex.uid and d.context != ex.context][:k]
            if len(demos) == k:
                break
        if len(demos) < k:
            where = f"{ex.task} ({head.strip()})" if head else ex.task
            raise DataError(f"{ex.uid}: the few-shot pool of {where} has {len(demos)} other "
                            f"examples to draw from, {k} asked")
        shots = [d.context[len(head):] + d.choices[d.gold] for d in demos]
        context = head + delimiter.join([*shots, ex.context[len(head):]])
        out.append(replace(ex, context=context))
    return out
