"""``kvgate eval longbench`` and its registry entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.eval.benchmarks.longbench.config import LongBenchConfig
from kvgate.eval.benchmarks.longbench.report import REPORT
from kvgate.eval.command import Command

if TYPE_CHECKING:
    from kvgate.eval.commands import EvalOutput, Loader


def run_longbench(cfg: LongBenchConfig, load: Loader | None = None) -> EvalOutput:
    """LongBench tasks per (task, policy, budget) with LongBench's metrics, question-agnostic
    unless ``query_aware``. The data is read before the model loads: an unreachable hub or a
    bad folder fails at once."""
    from kvgate.eval.benchmarks.longbench.run import evaluate_longbench, load_examples
    from kvgate.eval.commands import run_scored
    from kvgate.eval.qa_options import kv_storage

    examples = load_examples(cfg.tasks, cfg.source, cfg.limit)
    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_longbench(
        model, tokenizer, examples, policies, cfg.budgets, store, max_length=cfg.max_length,
        query_aware=cfg.query_aware, chat=cfg.chat, max_new_tokens=cfg.max_new_tokens,
        progress=cfg.progress, scores=cfg.score, kv=kv_storage(cfg)))


COMMAND = Command(LongBenchConfig, run_longbench, REPORT)
