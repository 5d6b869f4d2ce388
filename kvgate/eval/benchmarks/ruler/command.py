"""``kvgate eval ruler`` and its registry entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.eval.benchmarks.ruler.config import RulerConfig
from kvgate.eval.benchmarks.ruler.report import REPORT
from kvgate.eval.command import Command

if TYPE_CHECKING:
    from kvgate.eval.commands import EvalOutput, Loader


def run_ruler(cfg: RulerConfig, load: Loader | None = None) -> EvalOutput:
    """RULER-style task families per (task, length, policy, budget), question-agnostic unless
    ``query_aware``."""
    from kvgate.eval.benchmarks.ruler.run import evaluate_ruler
    from kvgate.eval.commands import run_scored
    from kvgate.eval.qa_options import kv_storage

    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_ruler(
        model, tokenizer, cfg.tasks, cfg.lengths, policies, cfg.budgets, store,
        depths=cfg.depths, limit=cfg.limit, query_aware=cfg.query_aware, chat=cfg.chat,
        seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, progress=cfg.progress,
        source=cfg.source, scores=cfg.score, kv=kv_storage(cfg)))


COMMAND = Command(RulerConfig, run_ruler, REPORT)
