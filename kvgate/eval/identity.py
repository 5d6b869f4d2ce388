"""What a stored result is checked against before a run reuses it.

The rule: every setting that changes a score is stored with the result and checked when a run
comes back to it; one that differs is refused in one line naming the setting and both values
(a changed setting never silently reuses, nor silently overwrites, what was scored before).

- Model identity (``model``, ``checkpoint``, ``weights``: a digest of the checkpoint's file
  inventory or of a local model folder, ``others_on``) is per folder, in ``meta``: a folder's
  table compares policies on one model (:class:`kvgate.eval.store.ResultStore`).
- What the result's key names is checked by the key itself: kind, task (with ``@Kshot``, the
  needle's ``length@depth``, the ppl window ``@C+K``, ruler's ``TASK@LENGTH``), policy label, budget (``matched-`` /
  ``matched~`` for the rounding and the reference), mode (the needle's scoring).
- The policy's name and options: the key's ``spec``.
- Every other score-changing setting: the key's ``settings`` (:meth:`settings` of each config in
  :mod:`kvgate.eval.config`): ``dtype``; for tasks ``split``, ``max_length``, ``truncate`` and, at
  k shots, ``fewshot_split`` and ``fewshot_seed``; for corpus texts ``text_files`` or ``docs``
  and ``seed``; for the needle ``seed``, ``samples``, ``distractors`` (rank) or
  ``max_new_tokens`` (generate) and ``query_aware``; for per-text perplexity ``max_length``,
  ``prefix`` and ``truncate``; for ruler ``seed``, ``depths``, ``chat``, ``max_new_tokens`` (the
  cap) and ``query_aware``, plus ``source``; for longbench ``source``, ``max_length``, ``chat``,
  ``max_new_tokens`` and ``query_aware``; for ruler, longbench, the needle, ppl, mc and matched
  the cache's storage, ``kv_bits`` (and at 8 or 4 bits ``kv_group`` and ``kv_residual``; their
  masked modes store nothing and take 16 bits only).
- Where the question goes is in the key as well: the needle's mode is ``rank-masked`` (the
  question compressed with the context, as every needle record before the question-agnostic
  default was) or ``rank-masked-agnostic`` (asked after compression); ruler's mode is
  ``agnostic`` or ``query-aware``, and so is longbench's. Old needle records read as query-aware (``LEGACY``).
- As a backstop every example stores a digest of the tokens it was scored on (``input``): an
  example whose tokens a run builds differently (data, prompt format or tokenizer changed) is
  refused too.

Not checked, since they do not change a score: ``batch_size``, ``device`` (the same numbers up to
floating-point noise), ``progress``, ``out``, ``patterns``, and what only selects examples
(``limit``, ppl ``windows``: a stored example is reused, a missing one scored).

Records written before settings were stored have none: each setting is then taken as the
record's own field where it has one (ppl stored ``max_length`` and ``prefix``), else as its
default at the time (``LEGACY``); a run at those values resumes the record, any other is
refused. Records without an ``input`` digest are taken as they are. A setting added later
(``ADDED``) is taken, where a record lacks it, as the value every run had before it existed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate.eval.errors import EvalError
from kvgate.eval.masked import ScoringItem

# each kind's settings in records that predate stored settings: the defaults of the time
LEGACY: dict[str, dict[str, Any]] = {
    "mc": {"dtype": "float32", "split": "validation", "max_length": None, "truncate": False,
           "fewshot_split": "validation", "fewshot_seed": 0},
    # needle records from before the question-agnostic default compressed the question too
    "needle": {"dtype": "float32", "text_files": None, "docs": 50, "seed": 0, "samples": 5,
               "distractors": 9, "max_new_tokens": 8, "query_aware": True},
    "ppl": {"dtype": "float32", "text_files": None, "docs": 50, "seed": 0, "max_length": 512,
            "prefix": 0.5, "truncate": False},
}


# settings added after results stored settings: what every record before them was scored at
ADDED: dict[str, Any] = {"kv_bits": 16}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def normal(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as they read back from the results file (tuples become lists)."""
    return json.loads(json.dumps(dict(settings)))


def check_settings(path: Path, key: str, record: Mapping[str, Any] | None,
                   settings: Mapping[str, Any] | None) -> None:
    """EvalError (one line) if ``record``, stored under ``key``, was scored with another value
    of a setting in ``settings`` (see the module docstring for records that have none)."""
    if record is None or settings is None:
        return
    stored = record.get("settings")
    legacy = LEGACY.get(key.split("|", 1)[0], {})
    for name, value in settings.items():
        if isinstance(stored, Mapping) and name in stored:
            old, why = stored[name], ""
        elif name in record:
            old, why = record[name], ""
        elif name in legacy:
            old, why = legacy[name], " (stored before settings were; the default then)"
        elif name in ADDED:
            old, why = ADDED[name], " (stored before the setting existed; the value then)"
        else:
            continue
        if old != value:
            raise EvalError(f"{path} holds {key} scored with {_flag(name)} {_show(old)}{why}, "
                            f"but this run has {_flag(name)} {_show(value)}: use another --out "
                            "folder, or the stored setting")


def input_digest(item: Any) -> str:
    """A short digest of the tokens an item is scored on (context and choices, or a needle
    prompt's ids)."""
    if isinstance(item, ScoringItem):
        payload: Any = [item.context, item.choices]
    else:
        payload = [tuple(getattr(item, "ids", ()))]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def check_inputs(path: Path, key: str, done: Mapping[str, Mapping[str, Any]],
                 digests: Mapping[str, str]) -> None:
    """EvalError if a stored example of ``key`` was scored on other tokens than this run built
    for it (``digests``: uid -> ``input_digest``); examples stored without one pass."""
    for uid, digest in digests.items():
        old = done.get(uid, {}).get("input")
        if old is not None and old != digest:
            raise EvalError(f"{path} holds {key} example {uid} scored on other tokens than this "
                            "run builds for it (the data, the prompt format or the tokenizer "
                            "changed): use another --out folder")
