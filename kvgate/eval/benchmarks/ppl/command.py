"""``kvgate eval ppl`` and its registry entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.eval.benchmarks.ppl.config import PPLConfig
from kvgate.eval.benchmarks.ppl.report import REPORT
from kvgate.eval.command import Command

if TYPE_CHECKING:
    from kvgate.eval.commands import EvalOutput, Loader


def run_ppl(cfg: PPLConfig, load: Loader | None = None) -> EvalOutput:
    """Perplexity under eviction (per text, or over fixed windows with ``context``)."""
    from kvgate.eval.benchmarks.ppl.run import evaluate_ppl
    from kvgate.eval.commands import finish, kept_on_interrupt, load_texts, loaded
    from kvgate.eval.qa_options import kv_storage

    model, tokenizer, policies, store = loaded(cfg, load, cfg.build_policies())
    with kept_on_interrupt(store):
        evaluate_ppl(model, tokenizer, load_texts(cfg), policies, cfg.budgets, store,
                     mode=cfg.mode, max_length=cfg.max_length, prefix=cfg.prefix,
                     batch_size=cfg.batch_size, progress=cfg.progress, context=cfg.context,
                     continuation=cfg.continuation, windows=cfg.windows,
                     truncate=cfg.truncate, step=cfg.step, from_files=bool(cfg.text_files),
                     kv=kv_storage(cfg))
    return finish(store)


COMMAND = Command(PPLConfig, run_ppl, REPORT)
