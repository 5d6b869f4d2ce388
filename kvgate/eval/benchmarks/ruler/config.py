"""``kvgate eval ruler``'s options, and the check of RULER task names (``--tasks``, shared
with ``kvgate eval calibrate``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.eval.config import EvalConfig, _at_least, parse_budgets, parse_numbers, parse_tasks
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.eval.qa_options import (
    check_qa,
    kv_bits_opt,
    kv_group_opt,
    kv_residual_opt,
    kv_settings,
    kv_storage,
    paired_opt,
    score_opt,
)

if TYPE_CHECKING:
    from kvgate.policies.base import Budget


def parse_ruler_tasks(raw: str | Sequence[str], allow_all: bool = True) -> list[str]:
    """``--tasks`` of the RULER families (``all``: the 13 of
    kvgate.eval.benchmarks.ruler.TASKS)."""
    from kvgate.eval.benchmarks.ruler.tasks import TASKS

    return parse_tasks(raw, list(TASKS), "RULER task", allow_all)


@dataclass
class RulerConfig(EvalConfig):
    """RULER-style task families (kvgate.eval.benchmarks.ruler), question asked after
    compression."""

    tasks: str | list[str] = opt("all", "comma-separated RULER tasks "
                                 "(kvgate.eval.benchmarks.ruler.TASKS), or all 13")
    lengths: str | list[int] = opt("1024,2048,4096", "context lengths in tokens")
    depths: str | list[float] = opt("0,25,50,75,100", "needle depths in % for the niah "
                                    "families (example s at depth s mod n)")
    limit: int = opt(5, "examples per (task, length)")
    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    query_aware: bool = opt(False, "prefill context and question together under the policy "
                            "(key mode query-aware) instead of asking the question after "
                            "compression")
    chat: bool = opt(True, "plain prompts even when the tokenizer has a chat template")
    seed: int = opt(0, "seed of the generated examples")
    max_new_tokens: int | None = opt(None, "cap on RULER's tokens to generate per family "
                                     "(niah 128, vt 30, cwe 120, fwe 50, qa 32)")
    source: str = opt("generated", "generated (offline, exact lengths), hub (kvpress's RULER, "
                      "lengths 4096-131072) or a save_to_disk folder of it")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tasks = parse_ruler_tasks(self.tasks)
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
        check_qa(self)
        kv_storage(self)  # a refused --kv-bits, --kv-group or --kv-residual: one line now

    def settings(self) -> dict[str, Any]:
        # --limit only selects (example s is the same at any limit); the mode is in the key
        return {**super().settings(), "seed": self.seed, "depths": self.depths,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware), "source": self.source,
                "score": self.score, **kv_settings(self)}
