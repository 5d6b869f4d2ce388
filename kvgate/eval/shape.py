"""The shape of a ``results.json``, checked whenever one is read.

Valid JSON is not enough: a file edited by hand, or written by another tool into the same
folder, may hold ``"meta": "x"`` or a list of examples, and every command that reads it would
then fail deep inside with a traceback. ``check_results`` names the first field that is off in
one line instead, before anything is scored or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.eval.errors import EvalError

KEY_PARTS = 5  # kind|task|policy|budget|mode (kvgate.eval.store.make_key)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value),
                                                                     type(value).__name__)


def check_results(path: str | Path, data: Any) -> dict[str, Any]:
    """``data`` (a parsed results.json at ``path``) when it has the shape kvgate writes:
    ``{"meta": {...}, "results": {KEY: {..., "examples": {ID: {...}}}}}``; otherwise
    ``EvalError`` naming the field, and what to do."""
    def bad(field: str, want: str, got: Any) -> EvalError:
        return EvalError(f"{path}: {field} should be {want}, found {_kind(got)}; not a "
                         "kvgate results file (or edited by hand): move it away")

    if not isinstance(data, dict):
        raise bad("the file", "an object with meta and results", data)
    if not isinstance(data.get("meta", {}), dict):
        raise bad("'meta'", "an object", data["meta"])
    results = data.get("results")
    if not isinstance(results, dict):
        raise bad("'results'", "an object of results by key", results)
    for key, record in results.items():
        if len(key.split("|")) != KEY_PARTS:
            raise EvalError(f"{path}: result key {key!r} is not kind|task|policy|budget|mode; "
                            "not a kvgate results file (or edited by hand): move it away")
        if not isinstance(record, dict):
            raise bad(f"results[{key!r}]", "an object", record)
        examples = record.get("examples", {})
        if not isinstance(examples, dict):
            raise bad(f"results[{key!r}].examples", "an object of examples by id", examples)
        for uid, example in examples.items():
            if not isinstance(example, dict):
                raise bad(f"results[{key!r}].examples[{uid!r}]", "an object", example)
    return data
