"""The eval commands: name -> config class, written out by hand (no decorator magic).

A command is its config dataclass (:mod:`kvgate.eval.config`, :mod:`kvgate.eval.config_long`):
its fields are the flags (:mod:`kvgate.eval.options`), its docstring's first line the
command's help, and its ``run(load)`` runs it. Adding a benchmark: one module (its config,
items and metric: docs/ARCHITECTURE.md, "Add a benchmark") and one line in ``COMMANDS``.
"""

from __future__ import annotations

from typing import Any

from kvgate.eval.calibrate import CalibrateConfig
from kvgate.eval.config import MatchedConfig, MCConfig, PatternConfig, ReportConfig
from kvgate.eval.config_long import LongBenchConfig, NeedleConfig, PPLConfig, RulerConfig
from kvgate.eval.errors import EvalError

COMMANDS: dict[str, type] = {
    "mc": MCConfig,
    "matched": MatchedConfig,
    "needle": NeedleConfig,
    "ppl": PPLConfig,
    "ruler": RulerConfig,
    "longbench": LongBenchConfig,
    "pattern": PatternConfig,
    "report": ReportConfig,
    "calibrate": CalibrateConfig,
}


def run_eval(cfg: Any, load: Any = None) -> Any:
    """The command of ``cfg``'s type (an ``EvalOutput``)."""
    if type(cfg) not in COMMANDS.values():
        raise EvalError(f"no eval command takes a {type(cfg).__name__}")
    return cfg.run(load)
