"""``kvgate eval needle`` and its registry entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.eval.benchmarks.needle.config import NeedleConfig
from kvgate.eval.benchmarks.needle.report import REPORT
from kvgate.eval.command import Command

if TYPE_CHECKING:
    from kvgate.eval.commands import EvalOutput, Loader


def run_needle(cfg: NeedleConfig, load: Loader | None = None) -> EvalOutput:
    """Passkey accuracy per (length, depth, policy, budget)."""
    from kvgate.eval.benchmarks.needle.run import evaluate_needle
    from kvgate.eval.commands import load_texts, run_scored
    from kvgate.eval.qa_options import kv_storage

    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_needle(
        model, tokenizer, load_texts(cfg), cfg.lengths, cfg.depths, policies, cfg.budgets,
        store, scoring=cfg.scoring, mode=cfg.mode, samples=cfg.samples,
        distractors=cfg.distractors, max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size, seed=cfg.seed, progress=cfg.progress,
        query_aware=cfg.query_aware, scores=cfg.score, kv=kv_storage(cfg)))


COMMAND = Command(NeedleConfig, run_needle, REPORT)
