"""The options of the commands over multiple-choice tasks: ``kvgate eval mc`` (fixed budgets),
``matched`` (the others at a reference policy's per-example eviction) and ``pattern`` (which
entries a policy keeps). ``mc`` and ``matched`` take the cache's storage (``--kv-bits``:
:mod:`kvgate.eval.qa_options`) for ``--mode cache``; ``pattern`` draws attention masks only, so
it has none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.eval.config import (
    MODES,
    EvalConfig,
    _at_least,
    _flagged,
    _one_of,
    parse_budgets,
    parse_policies,
    parse_tasks,
)
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.eval.qa_options import (
    kv_bits_opt,
    kv_cache_only,
    kv_group_opt,
    kv_residual_opt,
    kv_settings,
)

if TYPE_CHECKING:
    from kvgate.policies.base import Budget, Policy


@dataclass
class TaskConfig(EvalConfig):
    """Scoring commands over multiple-choice tasks."""

    tasks: str | list[str] = opt("rte,copa", "comma-separated task names")
    limit: int | None = opt(None, "first N examples of each task")
    split: str = opt("validation", "dataset split, or sft_test / sft_train: the held-out / "
                     "training part of the deterministic SFT cut (kvgate.data.load_sft_split)")
    max_length: int | None = opt(None, "cut contexts from the left to fit this many tokens")
    num_fewshot: int = opt(0, "solved examples before each context (kvgate.data.fewshot); "
                           "results are stored under TASK@Kshot", metavar="K")
    fewshot_split: str | None = opt(None, "split the demonstrations come from (default: "
                                    "--split; the example itself is never drawn)")
    fewshot_seed: int = opt(0, "seed of the demonstrations' draw")
    mode: str = opt("masked", "keep decisions as attention masks in one forward, or a real "
                    "compressed cache", choices=MODES)
    patterns: int = opt(3, "eviction-pattern plots of the first N examples for the learned "
                        "gate (0 = none)")
    truncate: bool = opt(False, "cut a context longer than the model's from the start (a "
                         "warning lists what was dropped) instead of refusing it")

    def __post_init__(self) -> None:
        super().__post_init__()
        from kvgate.data.tasks import TASKS

        self.tasks = parse_tasks(self.tasks, list(TASKS))
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
    """Multiple choice at fixed budgets."""

    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        kv_cache_only(self, self.mode == "cache")  # also a refused --kv-bits value: one line

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), **kv_settings(self)}


@dataclass
class MatchedConfig(TaskConfig):
    """Heuristics at the learned gate's per-example eviction ratio."""

    policies: str | list[str] = opt("snapkv,h2o", "comma-separated policy names, or 'all'")
    reference: str = opt("attention_gate", "policy whose per-example eviction the others "
                         "match; LABEL=POLICY takes --policy-opt LABEL.KEY=VALUE options")
    reference_budget: str | float | Budget = opt("0.5", "budget of a heuristic reference "
                                                 "(attention_gate and full ignore it)")
    rounding: str = opt("up", "each example's kept count per head from the reference's "
                        "eviction: rounded up (the others evict a little less), or to the "
                        "nearest token (the same eviction on average; budget label "
                        "matched~...)", choices=("up", "nearest"))
    others_on: str = opt("checkpoint", "what the other policies run on: the checkpoint's "
                         "model, or its frozen base with the LoRA adapter off (the "
                         "reference keeps it)", choices=("checkpoint", "base"))
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        _one_of(self.rounding, "--rounding", ("up", "nearest"))
        _one_of(self.others_on, "--others-on", ("checkpoint", "base"))
        if self.others_on == "base" and self.checkpoint is None:
            raise EvalError("--others-on base needs --checkpoint (a base model has no adapter "
                            "to switch off)")
        from kvgate.policies.base import Budget

        self.reference_budget = _flagged("--reference-budget", Budget.parse,
                                         self.reference_budget)
        self.build_reference()  # the reference and its options are checked first
        super().__post_init__()
        kv_cache_only(self, self.mode == "cache")

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), **kv_settings(self)}

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

    def gate_checked(self, policies: dict[str, Policy]) -> list[Policy]:
        return [self.build_reference()]


@dataclass
class PatternConfig(TaskConfig):
    """Plot which entries a policy keeps (at the first budget)."""

    policies: str | list[str] = opt("attention_gate", "comma-separated policy names")
    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets (the first is drawn)")
    samples: int = opt(3, "examples to draw")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.samples, "--samples")
