"""Evaluation harness: accuracy against eviction for every policy, long context, perplexity.

Shared by every benchmark (none of them names a benchmark):

- :mod:`.config`: what every command's config shares (``EvalConfig``, ``CorpusConfig``) and
  the checks of their values; :mod:`.options`: a config field is a flag; :mod:`.qa_options`:
  ``--score`` and ``--paired`` of the question-answering benchmarks;
- :mod:`.commands`: loading the model, the store of a run, Ctrl-C, paired differences around
  a benchmark's own scoring; ``kvgate eval report``;
- :mod:`.store`: the resumable results JSON; :mod:`.identity`: what a stored result is
  checked against before it is reused; :mod:`.shape`: a results file's shape;
- :mod:`.report`: results.md and the plots, from each kind's ``Report``; :mod:`.columns`: the
  table writers; :mod:`.plots`; :mod:`.intervals`: 95% intervals; :mod:`.paired`: each row's
  difference to a reference policy on the same examples;
- :mod:`.multiple_choice`: scoring continuations (zero- or k-shot multiple choice in
  ``masked`` or ``cache`` mode, fixed or matched budgets, %Evict as the Attention-Gate paper
  defines it; the needle's ranking and perplexity use it too); :mod:`.masked`: keep decisions
  applied as masks in one forward; :mod:`.resumable`: one result key scored example by
  example;
- :mod:`.runner`: the question-answering runner (every policy x budget x example, shared
  prefill, resumable records); :mod:`.asked`: one example asked after compression, or with
  its question compressed too; :mod:`.teacher`: answers scored in one forward;
- :mod:`.errors`: ``EvalError`` and the model and tokenizer facts every module reads.

One folder per benchmark, :mod:`.benchmarks` (``mc``, ``needle``, ``ppl``, ``ruler``,
``longbench``): its config, run, report and command. On top: :mod:`.calibrate` (``kvgate eval
calibrate``, a gate's threshold per length) and :mod:`.registry` (command name -> ``Command``:
config, run function, report; ``run_eval``). The command line is :mod:`kvgate.cli.evaluate`.

Plain perplexity of a model (no eviction) lives in :mod:`kvgate.models.perplexity`.

Command line: ``kvgate eval {mc,matched,needle,ppl,ruler,longbench,pattern,report,calibrate}
...`` (or ``python -m kvgate.eval ...``).

Names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EvalError": "errors", "ItemScore": "masked", "MaskedScoringCache": "masked",
    "ScoringItem": "masked", "masked_scores": "masked",
    "MODES": "multiple_choice", "cache_scores": "multiple_choice",
    "evaluate_matched": "multiple_choice", "evaluate_mc": "multiple_choice",
    "matched_budgets": "multiple_choice", "mc_item": "multiple_choice",
    "score_batch": "multiple_choice",
    "evaluate_needle": "benchmarks.needle.run", "evaluate_ppl": "benchmarks.ppl.run",
    "make_needle": "benchmarks.needle.run", "needle_set": "benchmarks.needle.run",
    "ppl_items": "benchmarks.ppl.run",
    "ResultStore": "store", "markdown_table": "report",
    "plot_eviction_pattern": "benchmarks.mc.report", "write_outputs": "report",
    "MCConfig": "benchmarks.mc.config", "MatchedConfig": "benchmarks.mc.config",
    "PatternConfig": "benchmarks.mc.config", "ReportConfig": "config",
    "NeedleConfig": "benchmarks.needle.config", "PPLConfig": "benchmarks.ppl.config",
    "RulerConfig": "benchmarks.ruler.config", "evaluate_ruler": "benchmarks.ruler.run",
    "LongBenchConfig": "benchmarks.longbench.config",
    "evaluate_longbench": "benchmarks.longbench.run",
    "COMMANDS": "registry", "Command": "command", "Report": "command", "run_eval": "registry",
    "run_qa": "runner", "QABenchmark": "runner", "QAItem": "runner", "Cell": "runner",
    "EvalOutput": "commands",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgate.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvgate.eval.{module}"), name)
