"""One typed config per evaluation command (``kvgate eval mc|matched|needle|ppl|ruler|longbench|
pattern|report``).

Each dataclass holds exactly the options of its command, named as its flags are
(``--max-length`` -> ``max_length``, ``--no-progress`` -> ``progress=False``). List options
take a comma-separated string, as on the command line, or a sequence, and are stored as lists
of their type; ``__post_init__`` checks every value before any model loads, and a bad one
raises :class:`~kvgate.eval.masked.EvalError` with one line that names the flag::

    from kvgate.eval import MCConfig, run_mc
    run_mc(MCConfig(out="out/x", model="smollm2-135m", tasks="rte,copa",
                    policies="full,snapkv", budgets=[0.5, 0.25], limit=50))

``policies`` keeps the command line's syntax: ``NAME`` or ``LABEL=NAME`` items (or ``all``),
with ``policy_opt`` items ``LABEL.KEY=VALUE`` (VALUE parsed as JSON when it can be).

``settings()`` of a config: the options besides the result key and the policy spec that change
its scores, stored with each result and checked when a run resumes it
(:mod:`kvgate.eval.identity`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.eval.errors import EvalError
from kvgate.files import check_output_dir
from kvgate.models.arch import parse_dtype
from kvgate.models.load import check_device
from kvgate.policies.base import Budget, Policy, PolicyError

MODES = ("masked", "cache")


def _csv(raw: str) -> list[str]:
    return [x.strip() for x in raw.split(",") if x.strip()]


def _items(value: str | Sequence[Any]) -> list[str]:
    return _csv(value) if isinstance(value, str) else [str(v).strip() for v in value]


def _flagged(flag: str, fn, *args, **kwargs):
    """``fn(...)`` with a policy/budget refusal turned into an EvalError naming ``flag``."""
    try:
        return fn(*args, **kwargs)
    except PolicyError as exc:
        raise EvalError(f"{flag}: {exc}") from None


def parse_budgets(raw: str | Sequence[Any]) -> list[Budget]:
    """``"0.5,128"`` (or ``[0.5, 128]``) -> kept ratios / token counts."""
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


def parse_tasks(raw: str | Sequence[str]) -> list[str]:
    from kvgate.data.tasks import TASKS

    names = _items(raw)
    if not names:
        raise EvalError("--tasks: give at least one task")
    for t in names:
        if t not in TASKS:
            raise EvalError(f"--tasks: unknown task {t!r}; known tasks: {', '.join(TASKS)}")
    return names


def parse_policies(raw: str | Sequence[str], options: Sequence[str] = ()) -> dict[str, Policy]:
    """``"snapkv,snap10=snapkv"`` + ``["snap10.window=0.1"]`` -> ``{label: policy}``; LABEL=NAME
    runs one policy under a second label (with its own options)."""
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
        if not sep or not dot or not key:
            raise EvalError(f"--policy-opt {item!r}: expected NAME.KEY=VALUE")
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
    """``kvgate eval report``: rewrite results.md and the plots of ``out`` from results.json."""

    out: str

    def __post_init__(self) -> None:
        if not str(self.out).strip():
            raise EvalError("--out: give the folder of a results.json")
        check_output_dir(self.out, "--out")


@dataclass
class EvalConfig:
    """What every scoring command shares: the model, the output folder, the policies."""

    out: str
    model: str | None = None            # --model: alias, folder, .gguf or hub id
    checkpoint: str | None = None       # --checkpoint: an exported gated checkpoint folder
    policies: str | list[str] = "full,snapkv,h2o"
    policy_opt: list[str] = field(default_factory=list)
    batch_size: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    progress: bool = True               # --no-progress: progress=False

    def __post_init__(self) -> None:
        if not str(self.out).strip():
            raise EvalError("--out: give an output folder")
        check_output_dir(self.out, "--out")  # a file (or a path through one): one line now
        if (self.model is None) == (self.checkpoint is None):
            raise EvalError("give one of --model or --checkpoint")
        _at_least(self.batch_size, "--batch-size")
        parse_dtype(self.dtype)
        check_device(self.device)  # a device this machine lacks: one line, before loading
        self.policies = _items(self.policies)
        self.policy_opt = list(self.policy_opt)
        self.build_policies()  # a bad name or option fails here, before any model loads

    def settings(self) -> dict[str, Any]:
        """What changes this command's scores besides the key and the policy spec."""
        return {"dtype": str(parse_dtype(self.dtype)).removeprefix("torch.")}

    @property
    def all_policies(self) -> bool:
        """``--policies all``: every policy this model can run (the gate only on a gated one)."""
        return self.policies == ["all"]

    def build_policies(self) -> dict[str, Policy]:
        """Fresh policy objects by label."""
        return parse_policies(self.policies, self.policy_opt)


@dataclass
class TaskConfig(EvalConfig):
    """Scoring commands over multiple-choice tasks."""

    tasks: str | list[str] = "rte,copa"
    limit: int | None = None            # first N examples of each task
    split: str = "validation"           # or sft_test / sft_train (kvgate.data.load_sft_split)
    max_length: int | None = None       # cut contexts from the left to this many tokens
    num_fewshot: int = 0                # solved examples before each context (TASK@Kshot)
    fewshot_split: str | None = None    # where demonstrations come from (default: split)
    fewshot_seed: int = 0
    mode: str = "masked"
    patterns: int = 3                   # eviction-pattern plots of the learned gate
    truncate: bool = False              # cut contexts longer than the model's (else refused)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tasks = parse_tasks(self.tasks)
        _at_least(self.limit, "--limit")
        _at_least(self.max_length, "--max-length")
        _at_least(self.num_fewshot, "--num-fewshot", 0)
        _at_least(self.patterns, "--patterns", 0)
        _one_of(self.mode, "--mode", MODES)

    def settings(self) -> dict[str, Any]:
        shots = {}
        if self.num_fewshot:  # the demonstrations' source matters only when there are some
            shots = {"fewshot_split": self.fewshot_split or self.split,
                     "fewshot_seed": self.fewshot_seed}
        return {**super().settings(), "split": self.split, "max_length": self.max_length,
                "truncate": bool(self.truncate), **shots}


@dataclass
class MCConfig(TaskConfig):
    """``kvgate eval mc``: multiple choice at fixed budgets."""

    budgets: str | list[Budget] = "0.5"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)


@dataclass
class MatchedConfig(TaskConfig):
    """``kvgate eval matched``: the other policies at the reference's per-example eviction."""

    policies: str | list[str] = "snapkv,h2o"
    reference: str = "attention_gate"   # LABEL=POLICY takes --policy-opt LABEL.KEY=VALUE
    reference_budget: str | float | Budget = "0.5"  # of a heuristic reference
    rounding: str = "up"                # each example's kept count: "up" or "nearest"
    others_on: str = "checkpoint"       # or "base": the checkpoint's base, LoRA adapter off

    def __post_init__(self) -> None:
        _one_of(self.rounding, "--rounding", ("up", "nearest"))
        _one_of(self.others_on, "--others-on", ("checkpoint", "base"))
        if self.others_on == "base" and self.checkpoint is None:
            raise EvalError("--others-on base needs --checkpoint (a base model has no adapter "
                            "to switch off)")
        self.reference_budget = _flagged("--reference-budget", Budget.parse,
                                         self.reference_budget)
        self.build_reference()  # the reference and its options are checked first
        super().__post_init__()

    @property
    def reference_label(self) -> str:
        return self.reference.partition("=")[0].strip()

    def _split_options(self) -> tuple[list[str], list[str]]:
        """(--policy-opt items of the reference's label, the others' items)."""
        mine = [o for o in self.policy_opt if o.partition(".")[0] == self.reference_label]
        return mine, [o for o in self.policy_opt if o not in mine]

    def build_reference(self) -> Policy:
        return parse_policies(self.reference, self._split_options()[0])[self.reference_label]

    def build_policies(self) -> dict[str, Policy]:
        return parse_policies(self.policies, self._split_options()[1])


@dataclass
class PatternConfig(TaskConfig):
    """``kvgate eval pattern``: plot which entries a policy keeps (first budget)."""

    policies: str | list[str] = "attention_gate"
    budgets: str | list[Budget] = "0.5"
    samples: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.samples, "--samples")


@dataclass
class CorpusConfig(EvalConfig):
    """Scoring commands over corpus texts."""

    budgets: str | list[Budget] = "0.5"
    docs: int = 50                      # the last N documents of the seeded corpus order
    text_files: list[str] | None = None  # .txt/.jsonl files instead of the embedded corpus
    seed: int = 0
    mode: str = "masked"

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


@dataclass
class NeedleConfig(CorpusConfig):
    """``kvgate eval needle``: passkey retrieval by context length and depth."""

    lengths: str | list[int] = "1024,2048"
    depths: str | list[float] = "0,25,50,75,100"
    samples: int = 5                    # prompts per (length, depth)
    scoring: str = "rank"               # or "generate" (always over the compressed cache)
    distractors: int = 9
    max_new_tokens: int = 8
    query_aware: bool = False           # the question inside the compressed prompt (the old way)

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.samples, "--samples")
        _at_least(self.max_new_tokens, "--max-new-tokens")
        _at_least(self.distractors, "--distractors", 0)
        _one_of(self.scoring, "--scoring", ("rank", "generate"))
        self.lengths = parse_numbers(self.lengths, "lengths", int)
        self.depths = parse_numbers(self.depths, "depths", float)

    def settings(self) -> dict[str, Any]:
        scorer = ({"distractors": self.distractors} if self.scoring == "rank"
                  else {"max_new_tokens": self.max_new_tokens})
        # the seed also draws the keys and the filler offsets; the sample count the offsets
        return {**super().settings(), "seed": self.seed, "samples": self.samples, **scorer,
                "query_aware": bool(self.query_aware)}


@dataclass
class PPLConfig(CorpusConfig):
    """``kvgate eval ppl``: perplexity of each text's rest given its compressed start."""

    max_length: int = 512
    prefix: float = 0.5                 # share of each text compressed
    context: int | None = None          # fixed context: windows of the joined texts
    continuation: int | None = None     # scored tokens per window (default: context)
    windows: int | None = None          # windows to score (default: all)
    truncate: bool = False              # cut texts longer than the model's context

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.max_length, "--max-length")
        if not 0.0 < self.prefix < 1.0:
            raise EvalError(f"--prefix must lie in (0, 1), got {self.prefix}")
        _at_least(self.context, "--context")
        _at_least(self.continuation, "--continuation")
        _at_least(self.windows, "--windows")

    def settings(self) -> dict[str, Any]:
        if self.context is not None:  # window sizes are in the key; --windows only selects
            return super().settings()
        return {**super().settings(), "max_length": self.max_length, "prefix": self.prefix,
                "truncate": bool(self.truncate)}


@dataclass
class RulerConfig(EvalConfig):
    """``kvgate eval ruler``: RULER-style task families, question asked after compression."""

    tasks: str | list[str] = "all"      # or a comma list of kvgate.eval.ruler.TASKS
    lengths: str | list[int] = "1024,2048,4096"  # context tokens
    depths: str | list[float] = "0,25,50,75,100"  # % of the haystack, needle families
    limit: int = 5                      # examples per (task, length)
    budgets: str | list[Budget] = "0.5"
    query_aware: bool = False           # the question inside the compressed prompt
    chat: bool = True                   # --no-chat: plain prompts on a model with a template
    seed: int = 0
    max_new_tokens: int | None = None   # caps RULER's tokens to generate per family
    source: str = "generated"           # or "hub" (kvpress's RULER) or a save_to_disk folder

    def __post_init__(self) -> None:
        from kvgate.eval.ruler.tasks import TASKS

        super().__post_init__()
        self.tasks = list(TASKS) if _items(self.tasks) == ["all"] else _items(self.tasks)
        if not self.tasks:
            raise EvalError("--tasks: give at least one task, or all")
        for t in self.tasks:
            if t not in TASKS:
                raise EvalError(f"--tasks: unknown RULER task {t!r}; known: {', '.join(TASKS)}")
        self.budgets = parse_budgets(self.budgets)
        self.lengths = parse_numbers(self.lengths, "lengths", int)
        self.depths = parse_numbers(self.depths, "depths", float)
        for n in self.lengths:
            _at_least(n, "--lengths", 16)
        for d in self.depths:
            if not 0.0 <= d <= 100.0:
                raise EvalError(f"--depths must lie in [0, 100] %, got {d:g}")
        _at_least(self.limit, "--limit")
        _at_least(self.max_new_tokens, "--max-new-tokens")

    def settings(self) -> dict[str, Any]:
        # --limit only selects (example s is the same at any limit); the mode is in the key
        return {**super().settings(), "seed": self.seed, "depths": self.depths,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware), "source": self.source}


@dataclass
class LongBenchConfig(EvalConfig):
    """``kvgate eval longbench``: LongBench (Bai et al., arXiv:2308.14508) with its metrics,
    question asked after compression."""

    tasks: str | list[str] = "en"       # task names and groups: en, zh, e (LongBench-E), all
    source: str = "hub"                 # kvpress's Xnhyacinth/LongBench, or a save_to_disk folder
    limit: int | None = None            # first N examples of each task (default all)
    budgets: str | list[Budget] = "0.5"
    max_length: int | None = None       # cut longer contexts in the middle to N tokens
    query_aware: bool = False           # the question inside the compressed prompt
    chat: bool = True                   # --no-chat: plain prompts on a model with a template
    max_new_tokens: int | None = None   # caps LongBench's tokens to generate per task

    def __post_init__(self) -> None:
        from kvgate.eval.longbench.scoring import LongBenchError, task_names

        super().__post_init__()
        try:
            self.tasks = task_names(_items(self.tasks))
        except LongBenchError as exc:
            raise EvalError(f"--tasks: {exc}") from None
        if not str(self.source).strip():
            raise EvalError("--source: give hub or a save_to_disk folder")
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.limit, "--limit")
        _at_least(self.max_length, "--max-length", 2)
        _at_least(self.max_new_tokens, "--max-new-tokens")

    def settings(self) -> dict[str, Any]:
        # --limit only selects (the first N of each task); the mode is in the key
        return {**super().settings(), "source": self.source, "max_length": self.max_length,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware)}
