"""Evaluation harness: accuracy against eviction for every policy, long context, perplexity.

- :mod:`.multiple_choice`: zero- or k-shot multiple choice in ``masked`` or ``cache`` mode, fixed
  or matched budgets, %Evict as the Attention-Gate paper defines it;
- :mod:`.masked`: the masked-mode attention (keep decisions applied as masks, one forward);
- :mod:`.needle`: passkey retrieval (length x depth);
- :mod:`.ppl`: perplexity under eviction;
- :mod:`.errors`: ``EvalError`` and the model and tokenizer facts every module reads;
- :mod:`.resumable`: one result key scored example by example, resumable;
- :mod:`.ruler`: RULER-style task families (generators, scoring, ``evaluate_ruler``, tables);
- :mod:`.longbench`: LongBench's tasks and metrics under eviction (``evaluate_longbench``);
- :mod:`.runner`: the question-answering runner RULER, LongBench and the needle's generate
  scoring share (every policy x budget x example, shared prefill, resumable records);
- :mod:`.asked`: one example asked after compression, or with its question compressed too;
- :mod:`.teacher`: answers scored in one forward (mean log-likelihood, greedy-exact);
- :mod:`.paired`: each row's difference to a reference policy on the same examples;
- :mod:`.intervals`: 95% intervals (Wilson's, of shares at 0-100% too) of mean scores;
- :mod:`.report`: resumable results JSON, markdown table, plots;
- :mod:`.identity`: what a stored result is checked against before it is reused (the model,
  every score-changing setting, each example's tokens);
- :mod:`.config`, :mod:`.config_long`: one typed config per command (``MCConfig``,
  ``MatchedConfig``, ``NeedleConfig``, ``PPLConfig``, ``RulerConfig``, ``LongBenchConfig``,
  ``PatternConfig``, ``ReportConfig``), checked on creation; its fields are its flags
  (:mod:`.options`);
- :mod:`.calibrate`: ``kvgate eval calibrate``, a gate's threshold per length for target
  eviction shares (its config, contexts and table; the search is
  :mod:`kvgate.inference.calibrate`);
- :mod:`.registry`: command name -> config (``COMMANDS``), ``run_eval``;
- :mod:`.commands`: each command as a function of its config (``run_mc(cfg)``, ...);
- :mod:`.flags`: the command line written from the registry.

Plain perplexity of a model (no eviction) lives in :mod:`kvgate.models.perplexity`.

Command line: ``kvgate eval {mc,matched,needle,ppl,ruler,longbench,pattern,report} ...`` (or
``python -m kvgate.eval ...``).

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
    "evaluate_needle": "needle", "evaluate_ppl": "ppl",
    "make_needle": "needle", "needle_set": "needle", "ppl_items": "ppl",
    "ResultStore": "report", "markdown_table": "report", "plot_eviction_pattern": "report",
    "write_outputs": "report",
    "MCConfig": "config", "MatchedConfig": "config", "NeedleConfig": "config_long",
    "PPLConfig": "config_long", "PatternConfig": "config", "ReportConfig": "config",
    "RulerConfig": "config_long", "run_ruler": "commands", "evaluate_ruler": "ruler.run",
    "LongBenchConfig": "config_long", "run_longbench": "commands",
    "COMMANDS": "registry", "run_qa": "runner", "QABenchmark": "runner", "QAItem": "runner",
    "Cell": "runner",
    "evaluate_longbench": "longbench.run",
    "EvalOutput": "commands", "run_eval": "registry", "run_matched": "commands",
    "run_mc": "commands", "run_needle": "commands", "run_pattern": "commands",
    "run_ppl": "commands", "run_report": "commands",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgate.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvgate.eval.{module}"), name)
