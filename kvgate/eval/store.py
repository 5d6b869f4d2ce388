"""The results of an output folder: ``results.json``, resumable, shared by concurrent runs.

``results.json`` layout::

    {"meta": {"model": ..., ...},
     "results": {KEY: {"kind": "mc"|"needle"|"ppl"|"ruler"|"longbench", "complete": bool,
                       <summary numbers>,
                       "spec": {"policy": NAME, "options": {...}},
                       "examples": {uid: {<per-example numbers>}}}}}

A KEY names one (kind, task, policy, budget, mode) run, e.g. ``mc|rte|snapkv|0.5|masked``;
its policy part is the run's label (``snap10=snapkv`` stores ``snap10``), and ``spec`` holds
what that label ran, so a resumed key never mixes two option sets (older files lack it).
``settings`` holds every other setting that changes its scores (``--max-length``, ``--dtype``,
...), each example the digest of its tokens (``input``), and ``meta`` the model's identity: a
run that differs in any of them is refused in one line (:mod:`kvgate.eval.identity`).
The file is rewritten atomically after every batch (at most every ``flush_s`` seconds) and
when a key completes, so an interrupted run keeps its finished keys *and* the examples of the
key it was in; a second run skips complete keys and finished examples.

Several runs may share one folder at once (e.g. two budgets side by side): each save takes an
exclusive lock, re-reads the file and merges: the keys this run has stored are its own, every
other key is the file's, so no run overwrites the keys of another (a key two runs both work on
holds the copy saved last).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.data.cache import read_json, write_json_atomic
from kvgate.eval.errors import EvalError
from kvgate.eval.identity import check_settings, normal
from kvgate.eval.shape import check_results

if TYPE_CHECKING:
    from kvgate.policies.base import Budget

RESULTS = "results.json"
LOCK = ".results.json.lock"

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one run per folder there
    fcntl = None


@contextlib.contextmanager
def _folder_lock(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    # the lock file stays behind on purpose: removing it would let a waiting run lock a file
    # that no longer has a name while a newcomer locks a new one
    with open(folder / LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def budget_label(budget: Budget | None) -> str:
    """``0.5`` for a ratio, ``128t`` for tokens, ``none`` when the policy ignores budgets."""
    if budget is None:
        return "none"
    return f"{budget.ratio:g}" if budget.ratio is not None else f"{budget.tokens}t"


def make_key(kind: str, task: str, policy: str, budget: str, mode: str) -> str:
    return f"{kind}|{task}|{policy}|{budget}|{mode}"


def split_key(key: str) -> dict[str, str]:
    kind, task, policy, budget, mode = key.split("|")
    return {"kind": kind, "task": task, "policy": policy, "budget": budget, "mode": mode}


class ResultStore:
    """The results JSON of one output folder (see the module docstring).

    ``meta`` identifies what produced the numbers (model, checkpoint, a digest of its
    ``weights``); a folder holding results of a different model is refused, so numbers never
    mix (a folder written before ``weights`` was stored takes it as it is). ``settings``: the
    run's score-changing settings, stored with every key it puts and checked against a key it
    resumes (``check_spec``); None checks and stores none.
    """

    def __init__(self, out_dir: str | Path, meta: dict[str, Any], flush_s: float = 30.0,
                 settings: dict[str, Any] | None = None) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / RESULTS
        self.flush_s = flush_s
        self._last = -math.inf  # the first partial state is written at once
        self._meta = dict(meta)
        self.settings = None if settings is None else normal(settings)
        self._touched: set[str] = set()  # keys this run has put; the others are the file's
        self._unsaved = False  # a key was put since the last write (flush() writes it)
        self.data = self._read() or {"meta": dict(meta), "results": {}}
        if meta.get("weights") is not None:  # a folder written before the digest gains it
            self.data["meta"].setdefault("weights", meta["weights"])

    def _read(self) -> dict[str, Any] | None:
        """The file's contents, checked to come from the same model and checkpoint."""
        if not self.path.exists():
            return None
        data = read_json(self.path)
        if data is None:
            raise EvalError(f"{self.path} exists but is not readable JSON of results; move it "
                            "away")
        check_results(self.path, data)  # the shape too: one line, not a traceback later
        old = data.setdefault("meta", {})
        for field in ("model", "checkpoint", "others_on", "weights"):
            if field == "weights" and None in (old.get(field), self._meta.get(field)):
                continue  # a folder (or a loader) without the digest: taken as it is
            if old.get(field) == self._meta.get(field):
                continue
            if field == "weights":
                raise EvalError(f"{self.path} holds results of other weights (digest "
                                f"{old[field]}, now {self._meta[field]}): the model or "
                                "checkpoint changed since; use another --out folder")
            raise EvalError(f"{self.path} holds results of {field} {old.get(field)!r}, not "
                            f"{self._meta.get(field)!r}; use another --out folder")
        return data

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return self.data["results"]

    def is_complete(self, key: str) -> bool:
        return bool(self.results.get(key, {}).get("complete"))

    def check_spec(self, key: str, spec: dict[str, Any] | None) -> None:
        """EvalError if ``key`` is stored with other settings than this run's, or with another
        policy spec than ``spec`` (records written before specs were stored have none and are
        taken as they are)."""
        check_settings(self.path, key, self.results.get(key), self.settings)
        stored = self.results.get(key, {}).get("spec")
        if spec is None or stored is None or stored == spec:
            return
        label = split_key(key)["policy"]
        raise EvalError(f"{self.path} holds {key} scored with {stored['policy']} options "
                        f"{stored['options']}, but this run's {label!r} is {spec['policy']} with "
                        f"{spec['options']}: give it another label (LABEL=POLICY) or --out folder")

    def examples(self, key: str) -> dict[str, Any]:
        """Per-example records already stored under ``key`` (a copy)."""
        return dict(self.results.get(key, {}).get("examples", {}))

    def has_example(self, key: str, uid: str) -> bool:
        """Whether ``key`` has a stored record of example ``uid`` (no copy of the records)."""
        return uid in self.results.get(key, {}).get("examples", {})

    def put(self, key: str, summary: dict[str, Any], examples: dict[str, Any],
            complete: bool) -> None:
        """Store a key's state; written now when complete, else at most every ``flush_s``."""
        settings = {} if self.settings is None else {"settings": self.settings}
        self.results[key] = {**split_key(key), **summary, **settings, "complete": complete,
                             "examples": examples}
        self._touched.add(key)
        self._unsaved = True
        if complete or time.monotonic() - self._last >= self.flush_s:
            self.save()

    def flush(self) -> None:
        """Write what was put since the last write (a run ending early: Ctrl-C); nothing when
        nothing was, so an interrupt before the first result creates no file."""
        if self._unsaved:
            self.save()

    def save(self) -> None:
        """Merge this run's keys into the file as it is now, under the folder's lock."""
        with _folder_lock(self.dir):
            disk = self._read()
            if disk is not None:
                merged = disk["results"]
                for key, mine in self.results.items():
                    if key in self._touched or key not in merged:
                        merged[key] = mine
                self.data["results"] = merged
            write_json_atomic(self.path, self.data)
        self._last = time.monotonic()
        self._unsaved = False

    def complete_results(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.results.values()
                if r.get("complete") and (kind is None or r.get("kind") == kind)]
