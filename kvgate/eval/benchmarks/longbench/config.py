"""``kvgate eval longbench``'s options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.eval.config import EvalConfig, _at_least, _items, parse_budgets
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


@dataclass
class LongBenchConfig(EvalConfig):
    """LongBench tasks with LongBench's metrics (kvgate.eval.benchmarks.longbench), question
    asked after compression (Bai et al., arXiv:2308.14508)."""

    tasks: str | list[str] = opt("en", "comma-separated LongBench tasks (hotpotqa, qasper-e for "
                                 "LongBench-E, ...) and groups: en (the 16 English and code "
                                 "tasks), zh, e (the 13 LongBench-E tasks), all")
    source: str = opt("hub", "hub (kvpress's Xnhyacinth/LongBench) or a save_to_disk folder of "
                      "it or of THUDM's layout (one sub-folder per task, or one dataset)")
    limit: int | None = opt(None, "first N examples of each task (default all)")
    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    max_length: int | None = opt(None, "cut a context of more tokens in the middle, keeping its "
                                 "first and last N/2 (LongBench's cut; default none: a prompt "
                                 "longer than the model's context is refused)")
    query_aware: bool = opt(False, "prefill context and question together under the policy "
                            "(key mode query-aware) instead of asking after compression")
    chat: bool = opt(True, "plain prompts even when the tokenizer has a chat template (trec, "
                     "triviaqa, samsum, lsht, lcc, repobench-p always are)")
    max_new_tokens: int | None = opt(None, "cap on LongBench's tokens to generate per task "
                                     "(32 to 512)")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        from kvgate.eval.benchmarks.longbench.scoring import LongBenchError, task_names

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
        check_qa(self)
        kv_storage(self)  # a refused --kv-bits, --kv-group or --kv-residual: one line now

    def settings(self) -> dict[str, Any]:
        # --limit only selects (the first N of each task); the mode is in the key
        return {**super().settings(), "source": self.source, "max_length": self.max_length,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware), "score": self.score, **kv_settings(self)}
