"""Deterministic SFT train/test parts for the multiple-choice tasks.

Only validation splits ship embedded, so each task's validation split is cut in two:

- every example gets a bucket ``u = int(sha1(f"{seed}:{task}:{key}")[:16], 16) / 2**64`` in
  [0, 1); ``u < test_fraction`` -> ``test``, otherwise ``train`` (default 70 % / 30 %, seed 0);
- ``key`` is the passage the example reads: the context up to its last ``"\\nQuestion:"``
  (BoolQ passage, RTE premise, SciQ support) or the whole context when there is none, in
  lower case with runs of whitespace collapsed. Examples that share a passage or a prompt
  (BoolQ asks several questions about one passage; PIQA repeats some goals) therefore always
  land in the same part, so no test prompt or passage is seen in training.

The cut depends only on the text and the seed: it is the same on every machine, in every run,
whatever the order or ``limit`` of loading, and adding examples never moves existing ones.
Both parts keep dataset order. With ``source="hub"`` the real splits are used instead
(``train`` -> the Hub train split, MMLU's ``auxiliary_train``; ``test`` -> the Hub validation
split) and ``test_fraction``/``seed`` play no part.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from kvgate.data.errors import DataError
from kvgate.data.tasks import MCExample, Source, load_task

Part = Literal["train", "test"]
DEFAULT_TEST_FRACTION = 0.3

_SPACES = re.compile(r"\s+")


def split_key(example: MCExample) -> str:
    """The normalised passage (or whole prompt) that decides an example's part."""
    head, marker, _ = example.context.rpartition("\nQuestion:")
    passage = head if marker else example.context
    return _SPACES.sub(" ", passage).strip().lower()


def split_bucket(example: MCExample, seed: int = 0) -> float:
    """Position in [0, 1) of ``example``'s split key under ``seed``."""
    digest = hashlib.sha1(f"{seed}:{example.task}:{split_key(example)}".encode())
    return int(digest.hexdigest()[:16], 16) / 2.0**64


def _check(part: str, test_fraction: float) -> None:
    if part not in ("train", "test"):
        raise DataError(f"part must be 'train' or 'test', got {part!r}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) \
            or not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")


def split_examples(examples: list[MCExample], part: Part,
                   test_fraction: float = DEFAULT_TEST_FRACTION,
                   seed: int = 0) -> list[MCExample]:
    """The ``part`` of ``examples`` under the hash rule above (dataset order kept)."""
    _check(part, test_fraction)
    want_test = part == "test"
    return [e for e in examples if (split_bucket(e, seed) < test_fraction) == want_test]


def load_sft_split(task: str, part: Part, test_fraction: float = DEFAULT_TEST_FRACTION,
                   seed: int = 0, source: Source = "embedded") -> list[MCExample]:
    """Train or held-out test examples of ``task`` for supervised fine-tuning."""
    _check(part, test_fraction)
    if source == "hub":
        return load_task(task, "train" if part == "train" else "validation", source="hub")
    if source != "embedded":
        raise DataError(f"source must be 'embedded' or 'hub', got {source!r}")
    return split_examples(load_task(task, "validation"), part, test_fraction, seed)
