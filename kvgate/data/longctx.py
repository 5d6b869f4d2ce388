"""Long-context benchmarks (RULER, LongBench) in the form kvpress's evaluation uses.

Every example is a :class:`LongExample`: a long ``context`` that is prefilled (and compressed)
once, a ``question`` asked after it, an ``answer_prefix`` that starts the reply, and the
reference ``answers``. Two sources per loader:

- ``source="hub"``: ``datasets.load_dataset`` on the kvpress-formatted hub copies, exactly as
  kvpress's ``evaluation/evaluate.py`` loads them (``data_dir=<length or task>``, split
  ``test``), after kvgate's fast reachability check (offline it fails in one line);
- ``source=<path>``: ``datasets.load_from_disk`` on a local copy (a ``Dataset`` or a
  ``DatasetDict`` with a ``test`` split), either for one length/task or a folder holding one
  sub-folder per length/task (``<path>/4096``, ``<path>/hotpotqa``).

Column layouts read:

- RULER, ``simonjegou/ruler`` (data_dir = context length "4096", "8192", ...): ``context``,
  ``question``, ``answer_prefix``, ``answer`` (list of strings; ``answers`` is accepted too),
  ``task`` (``niah_single_1``, ..., ``qa_2``), ``max_new_tokens``.
- LongBench, ``Xnhyacinth/LongBench`` (data_dir = task, ``-e`` suffix for LongBench-E):
  ``context``, ``question``, ``answer_prefix``, ``answers``, ``task``, ``all_classes``,
  ``length``, ``max_new_tokens`` (``_id`` when present). A local copy of the original
  ``THUDM/LongBench`` layout (``input``, ``context``, ``answers``, ``length``, ``dataset``,
  ``all_classes``, ``_id``) is read as well: ``input`` becomes the question and
  ``answer_prefix`` is ``"Answer:"``; kvpress's per-task prompt templates are not applied.
  The hub source is only the kvpress form (THUDM's copy is a loading script).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.data.errors import DataError
from kvgate.data.hub import load_hub_dataset

RULER_HUB = "simonjegou/ruler"
LONGBENCH_HUB = "Xnhyacinth/LongBench"
HUB_SPLIT = "test"

RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)
LONGBENCH_TASKS = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa",
    "musique", "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa",
    "samsum", "lsht", "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc",
    "repobench-p",
)
# LongBench-E: the tasks with the length-balanced subset (data_dir "<task>-e")
LONGBENCH_E_TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
THUDM_ANSWER_PREFIX = "Answer:"

_HUB_HINT = "pass source=<path> to a local copy saved with datasets' save_to_disk"


@dataclass
class LongExample:
    """One long-context question; ``answers`` holds every accepted reference string."""

    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    task: str
    id: str
    length: int | None = None
    max_new_tokens: int | None = None
    all_classes: list[str] | None = None

    def __hash__(self) -> int:
        return hash((self.task, self.id))


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit must be None or an integer >= 0, got {limit!r}")


def _pick_split(data: Any, where: str) -> Any:
    """A ``Dataset`` from ``load_from_disk``'s answer (the ``test`` split of a DatasetDict)."""
    if hasattr(data, "column_names") and isinstance(data.column_names, list):
        return data
    splits = list(data.keys())
    if HUB_SPLIT in splits:
        return data[HUB_SPLIT]
    if len(splits) == 1:
        return data[splits[0]]
    raise DataError(f"{where}: a DatasetDict needs a '{HUB_SPLIT}' split, found {splits}")


def _load_local(path: Path, sub: str, *, kind: str) -> tuple[Any, bool]:
    """Load ``path/sub`` if it exists, else ``path`` itself; True when the sub-folder was used.

    A folder of per-``kind`` sub-folders that lacks ``sub`` is a one-line DataError naming
    what it does hold.
    """
    if not path.is_dir():
        raise DataError(f"no dataset at {path}: the path does not exist or is not a folder")
    for where, used_sub in ((path / sub, True), (path, False)):
        if where.is_dir() and _is_saved_dataset(where):
            import datasets  # late: ~1.5 s to import

            try:
                data = datasets.load_from_disk(str(where))
            except Exception as err:
                first = (str(err).strip().splitlines() or [""])[0]
                raise DataError(f"could not read {where}: {type(err).__name__}: {first}") from err
            return _pick_split(data, str(where)), used_sub
    held = sorted(p.name for p in path.iterdir() if p.is_dir() and _is_saved_dataset(p))
    if held:
        raise DataError(f"unknown {kind} {sub!r} in {path}: it holds {', '.join(held)}")
    raise DataError(f"{path} is not a dataset saved with save_to_disk (and has no {sub}/ in it)")


def _is_saved_dataset(path: Path) -> bool:
    names = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any((path / n).is_file() for n in names)


def _require(columns: list[str], needed: tuple[str, ...], where: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DataError(f"{where}: missing column(s) {', '.join(missing)}; "
                        f"found {', '.join(columns)}")


def _answers(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        return list(value)
    raise DataError(f"{where}: answers must be a string or a list of strings, got {value!r:.60}")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _check_tasks(tasks: Any, known: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    if tasks is None:
        return None
    chosen = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    bad = [t for t in chosen if t not in known]
    if bad or not chosen:
        raise DataError(f"unknown {what} task(s) {bad or chosen!r}; known: {', '.join(known)}")
    return chosen


def _rows_where(data: Any, column: str, accepted: set[str]) -> Any:
    """The rows whose ``column`` is in ``accepted``: an index selection, which (unlike
    ``Dataset.filter``) writes no progress bar on stderr and no cache file."""
    return data.select([i for i, v in enumerate(data[column]) if v in accepted])


def load_ruler(length: int, tasks: str | list[str] | None = None, source: str | Path = "hub",
               limit: int | None = None) -> list[LongExample]:
    """RULER examples at one context ``length`` (tokens), optionally only some ``tasks``.

    ``limit`` keeps the first ``limit`` examples after the task filter. Task names are the
    kvpress ones (:data:`RULER_TASKS`); lengths are :data:`RULER_LENGTHS`.
    """
    _check_limit(limit)
    if isinstance(length, bool) or not isinstance(length, int) or length not in RULER_LENGTHS:
        raise DataError(f"unknown RULER length {length!r}; known: "
                        f"{', '.join(map(str, RULER_LENGTHS))}")
    chosen = _check_tasks(tasks, RULER_TASKS, "RULER")
    if source == "hub":
        data = load_hub_dataset(RULER_HUB, split=HUB_SPLIT, data_dir=str(length), hint=_HUB_HINT)
        where = f"{RULER_HUB} [{length}]"
    else:
        data, _ = _load_local(Path(source), str(length), kind="RULER length")
        where = f"RULER copy {source}"
    columns = list(data.column_names)
    answer_col = "answer" if "answer" in columns else "answers"
    _require(columns, ("context", "question", "answer_prefix", answer_col, "task"), where)
    if chosen is not None:
        data = _rows_where(data, "task", set(chosen))
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    out = []
    for i, row in enumerate(data):
        task = row["task"]
        if task not in RULER_TASKS:
            raise DataError(f"{where}: row {i} has unknown task {task!r}")
        ident = row.get("id", row.get("index", i))
        out.append(LongExample(
            context=row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
            answers=_answers(row[answer_col], f"{where} row {i}"), task=task,
            id=f"ruler-{length}:{task}:{ident}", length=length,
            max_new_tokens=_opt_int(row.get("max_new_tokens"))))
    return out


def _longbench_task(task: str) -> tuple[str, str]:
    """(data_dir, base task) for a LongBench task name, ``-e`` suffix for LongBench-E."""
    base = task.removesuffix("-e")
    known_e = tuple(f"{t}-e" for t in LONGBENCH_E_TASKS)
    if base not in LONGBENCH_TASKS or (task.endswith("-e") and base not in LONGBENCH_E_TASKS):
        raise DataError(f"unknown LongBench task {task!r}; known: {', '.join(LONGBENCH_TASKS)}"
                        f" (LongBench-E: {', '.join(known_e)})")
    return task, base


def _longbench_row(row: dict[str, Any], i: int, task: str, thudm: bool,
                   where: str) -> LongExample:
    ident = row.get("_id") or row.get("id") or i
    classes = row.get("all_classes")
    return LongExample(
        context=row["context"],
        question=row["input"] if thudm else row["question"],
        answer_prefix=THUDM_ANSWER_PREFIX if thudm else row["answer_prefix"],
        answers=_answers(row["answers"], f"{where} row {i}"),
        task=task, id=f"longbench:{task}:{ident}",
        length=_opt_int(row.get("length")), max_new_tokens=_opt_int(row.get("max_new_tokens")),
        all_classes=list(classes) if classes else None)


def load_longbench(task: str, source: str | Path = "hub",
                   limit: int | None = None) -> list[LongExample]:
    """LongBench examples of one ``task`` (``"hotpotqa"``; ``"hotpotqa-e"`` for LongBench-E).

    The hub source is kvpress's ``Xnhyacinth/LongBench``; a local copy may be that layout or
    the original ``THUDM/LongBench`` one (see the module docstring). A local dataset holding
    several tasks is filtered by its ``task`` (kvpress) or ``dataset`` (THUDM) column.
    """
    _check_limit(limit)
    data_dir, base = _longbench_task(task)
    if source == "hub":
        data = load_hub_dataset(LONGBENCH_HUB, split=HUB_SPLIT, data_dir=data_dir, hint=_HUB_HINT)
        where, one_task = f"{LONGBENCH_HUB} [{data_dir}]", True
    else:
        data, one_task = _load_local(Path(source), data_dir, kind="LongBench task")
        where = f"LongBench copy {source}"
    columns = list(data.column_names)
    thudm = "input" in columns and "question" not in columns
    if thudm:
        _require(columns, ("input", "context", "answers"), where)
        task_col = "dataset"
    else:
        _require(columns, ("context", "question", "answer_prefix", "answers"), where)
        task_col = "task"
    if not one_task:
        # one dataset holding several tasks: keep this one's rows (THUDM spells "-e" as "_e")
        _require(columns, (task_col,), f"{where} (several tasks in one dataset)")
        accepted = {task, f"{base}_e"} if task.endswith("-e") else {task}
        data = _rows_where(data, task_col, accepted)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return [_longbench_row(row, i, task, thudm, where) for i, row in enumerate(data)]
