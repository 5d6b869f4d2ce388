"""What every evaluation command's config shares (``EvalConfig``: the model, the output
folder, the policies; ``CorpusConfig``: texts of the corpus or of files) and the checks of
their values; ``ReportConfig`` (``kvgate eval report``). Each benchmark's own config sits in
its folder (``kvgate.eval.benchmarks.<name>.config``).

Each dataclass holds exactly the options of its command, named as its flags are
(``--max-length`` -> ``max_length``, ``--no-progress`` or ``--quiet`` -> ``progress=False``);
each field is declared with its flag's help (:func:`kvgate.eval.options.opt`), so the command
line is written from it and every default lives here once; the registry
(:mod:`kvgate.eval.registry`) runs it. List options take a comma-separated string, as on the
command line, or a sequence, and are stored as lists of their type; ``__post_init__`` checks
every value before any model loads, and a bad one raises
:class:`~kvgate.eval.errors.EvalError` with one line that names the flag::

    from kvgate.eval import MCConfig, run_eval
    run_eval(MCConfig(out="out/x", model="smollm2-135m", tasks="rte,copa",
                      policies="full,snapkv", budgets=[0.5, 0.25], limit=50))

``policies`` keeps the command line's syntax: ``NAME`` or ``LABEL=NAME`` items (or ``all``),
with ``policy_opt`` items ``LABEL.KEY=VALUE`` (VALUE parsed as JSON when it can be; ``KEY=VALUE``
when there is one label).

``settings()`` of a config: the options besides the result key and the policy spec that change
its scores, stored with each result and checked when a run resumes it
(:mod:`kvgate.eval.identity`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.files import check_output_dir

if TYPE_CHECKING:  # the configs are read to build the flags: they import no torch until run
    from kvgate.policies.base import Budget, Policy

MODES = ("masked", "cache")


def _csv(raw: str) -> list[str]:
    return [x.strip() for x in raw.split(",") if x.strip()]


def _items(value: str | Sequence[Any]) -> list[str]:
    return _csv(value) if isinstance(value, str) else [str(v).strip() for v in value]


def _flagged(flag: str, fn, *args, **kwargs):
    """``fn(...)`` with a policy/budget refusal turned into an EvalError naming ``flag``."""
    from kvgate.policies.base import PolicyError

    try:
        return fn(*args, **kwargs)
    except PolicyError as exc:
        raise EvalError(f"{flag}: {exc}") from None


def parse_budgets(raw: str | Sequence[Any]) -> list[Budget]:
    """``"0.5,128"`` (or ``[0.5, 128]``) -> kept ratios / token counts."""
    from kvgate.policies.base import Budget

    values = _items(raw) if isinstance(raw, str) else list(raw)
    if not values:
        raise EvalError("--budgets: give at least one budget")
    return [_flagged("--budgets", Budget.parse, v) for v in values]


def parse_numbers(raw: str | Sequence[Any], what: str, kind: type) -> list[Any]:
    """A comma-separated list (or a sequence) of ``kind`` values for ``--what``."""
    try:
        values = [kind(v) for v in (_csv(raw) if isinstance(raw, str) else raw)]
    except (TypeError, ValueError):
        raise EvalError(f"--{what}: {raw!r} is not a comma-separated list of numbers") from None
    if not values:
        raise EvalError(f"--{what}: give at least one value")
    return values




def parse_policies(raw: str | Sequence[str], options: Sequence[str] = ()) -> dict[str, Policy]:
    """``"snapkv,snap10=snapkv"`` + ``["snap10.window=0.1"]`` -> ``{label: policy}``; LABEL=NAME
    runs one policy under a second label (with its own options). With one label, an option
    may leave it out (``window=0.1``, as ``kvgate infer`` takes it)."""
    from kvgate.policies import list_policies
    from kvgate.policies.registry import get_policy, policy_class

    items = _items(raw)
    if items == ["all"]:
        items = list_policies()
    if not items:
        raise EvalError("--policies: give at least one policy")
    kinds: dict[str, str] = {}
    for item in items:
        label, sep, kind = item.partition("=")
        label, kind = label.strip(), (kind.strip() if sep else label.strip())
        if not label or not kind or label in kinds:
            raise EvalError(f"--policies: {item!r} is empty or repeats a label")
        kinds[label] = kind
    per: dict[str, dict[str, Any]] = {n: {} for n in kinds}
    for item in options:
        target, sep, raw_value = item.partition("=")
        name, dot, key = target.partition(".")
        if sep and not dot and target.strip() and len(per) == 1:
            # kvgate infer's KEY=VALUE: with one policy asked, NAME can only be its label
            name, key = next(iter(per)), target
        if not sep or not key.strip() or not name.strip():
            only = " (KEY=VALUE only when --policies names one)" if len(per) > 1 else ""
            raise EvalError(f"--policy-opt {item!r}: expected NAME.KEY=VALUE, NAME a label of "
                            f"--policies{only}")
        name, key = name.strip(), key.strip()
        if name not in per:
            raise EvalError(f"--policy-opt {item!r}: policy {name!r} is not in --policies")
        try:
            per[name][key] = json.loads(raw_value)
        except json.JSONDecodeError:
            per[name][key] = raw_value
    policies = {}
    for label, kind in kinds.items():
        _flagged("--policies", policy_class, kind)
        policies[label] = _flagged("--policy-opt" if per[label] else "--policies", get_policy,
                                   kind, **per[label])
    return policies


def parse_tasks(raw: str | Sequence[str], known: Sequence[str], what: str = "task",
                allow_all: bool = False) -> list[str]:
    """``--tasks``: names among ``known`` (``all``: every one, where ``allow_all``); one line
    naming the first unknown ``what`` and the known ones."""
    names = _items(raw)
    if allow_all and names == ["all"]:
        return list(known)
    if not names:
        raise EvalError("--tasks: give at least one task" + (", or all" if allow_all else ""))
    for t in names:
        if t not in known:
            raise EvalError(f"--tasks: unknown {what} {t!r}; known: {', '.join(known)}")
    return names


def _at_least(value: int | None, flag: str, low: int = 1) -> None:
    if value is not None and value < low:
        raise EvalError(f"{flag} must be >= {low}, got {value}")


def _one_of(value: str, flag: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise EvalError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# the configs


@dataclass
class ReportConfig:
    """Rewrite results.md and the plots of ``out`` from results.json (no model)."""

    out: str = opt(help="the folder of a results.json")

    def __post_init__(self) -> None:
        if not str(self.out).strip():
            raise EvalError("--out: give the folder of a results.json")
        check_output_dir(self.out, "--out")


@dataclass
class EvalConfig:
    """What every scoring command shares: the model, the output folder, the policies."""

    out: str = opt(help="output folder (results.json, .md, .png)")
    model: str | None = opt(None, "base model: alias (smollm2-135m), folder, .gguf, hub id",
                            group="model")
    checkpoint: str | None = opt(None, "exported gated checkpoint folder, a KVzap checkpoint "
                                 "folder, or a hub id of either", group="model")
    base: str | None = opt(None, "the base model under --checkpoint when the checkpoint names "
                           "none (a published KVzap checkpoint)")
    policies: str | list[str] = opt("full,snapkv,h2o",
                                    "comma-separated policy names (LABEL=NAME runs a policy "
                                    "under a second label), or 'all'")
    policy_opt: list[str] = opt(factory=list, help="a policy option, NAME.KEY=VALUE (VALUE "
                                "parsed as JSON when it can be; KEY=VALUE when --policies "
                                "names one); repeatable",
                                action="append", metavar="NAME.KEY=VALUE")
    batch_size: int = opt(8, "examples per forward")
    dtype: str = opt("float32", "model weights' dtype")
    device: str = opt("cpu", "torch device")
    progress: bool = opt(True, "no progress on stderr (a bar on a terminal, else a line every "
                         "few seconds)", also=("--quiet",))

    def __post_init__(self) -> None:
        if not str(self.out).strip():
            raise EvalError("--out: give an output folder")
        check_output_dir(self.out, "--out")  # a file (or a path through one): one line now
        if (self.model is None) == (self.checkpoint is None):
            raise EvalError("give one of --model or --checkpoint")
        if self.base is not None and self.checkpoint is None:
            raise EvalError("--base names the base under --checkpoint; with --model leave it out")
        _at_least(self.batch_size, "--batch-size")
        from kvgate.models.arch import parse_dtype
        from kvgate.models.load import check_device

        parse_dtype(self.dtype)
        check_device(self.device)  # a device this machine lacks: one line, before loading
        self.policies = _items(self.policies)
        self.policy_opt = list(self.policy_opt)
        self.build_policies()  # a bad name or option fails here, before any model loads

    def settings(self) -> dict[str, Any]:
        """What changes this command's scores besides the key and the policy spec."""
        from kvgate.models.arch import parse_dtype

        return {"dtype": str(parse_dtype(self.dtype)).removeprefix("torch.")}

    @property
    def all_policies(self) -> bool:
        """``--policies all``: every policy this model can run (the gate only on a gated one)."""
        return self.policies == ["all"]

    def build_policies(self) -> dict[str, Policy]:
        """Fresh policy objects by label."""
        return parse_policies(self.policies, self.policy_opt)

    def gate_checked(self, policies: dict[str, Policy]) -> list[Policy]:
        """The policies whose gate the loaded model must have (``matched``: its reference)."""
        return list(policies.values())


@dataclass
class CorpusConfig(EvalConfig):
    """Scoring commands over corpus texts."""

    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    docs: int = opt(50, "corpus documents to use: the last N of the seeded corpus order "
                    "(after any training prefix)")
    text_files: list[str] | None = opt(None, "use these .txt/.jsonl files instead of the "
                                       "embedded corpus", nargs="*")
    seed: int = opt(0, "seed of the corpus order (and of the needle's keys and offsets)")
    mode: str = opt("masked", "keep decisions as attention masks in one forward, or a real "
                    "compressed cache", choices=MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.docs, "--docs")
        _one_of(self.mode, "--mode", MODES)
        if self.text_files:  # a missing, malformed or non-UTF-8 file: one line before loading
            from kvgate.data import load_text_files

            load_text_files(self.text_files)

    def settings(self) -> dict[str, Any]:
        if self.text_files:
            texts: dict[str, Any] = {"text_files": [str(Path(f).resolve())
                                                    for f in self.text_files]}
        else:
            texts = {"text_files": None, "docs": self.docs, "seed": self.seed}
        return {**super().settings(), **texts}
