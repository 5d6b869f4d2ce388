"""The eval commands: name -> ``Command`` (config class, run function, report of its results),
written out by hand (no decorator magic).

A command's config dataclass is its flags (:mod:`kvgate.eval.options`), its docstring's first
line the command's help; ``run_eval`` runs it and, for a command that stores results, writes
results.md and the plots of every kind of result the folder holds, each drawn by its
benchmark's ``Report``, in the order of ``COMMANDS``. A benchmark is one folder
(``kvgate.eval.benchmarks.<name>``: config, run, report, command) and one line here
(docs/ARCHITECTURE.md, "Add a benchmark").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvgate.eval.benchmarks.longbench import command as longbench
from kvgate.eval.benchmarks.mc import command as mc
from kvgate.eval.benchmarks.needle import command as needle
from kvgate.eval.benchmarks.ppl import command as ppl
from kvgate.eval.benchmarks.ruler import command as ruler
from kvgate.eval.calibrate import CalibrateConfig, run_calibrate
from kvgate.eval.command import Command, Report
from kvgate.eval.config import ReportConfig
from kvgate.eval.errors import EvalError

if TYPE_CHECKING:
    from kvgate.eval.commands import Loader


def _run_report(cfg: ReportConfig, load: Loader | None = None) -> Any:
    from kvgate.eval.commands import run_report

    return run_report(cfg, load)


COMMANDS: dict[str, Command] = {
    "mc": mc.MC,
    "matched": mc.MATCHED,
    "needle": needle.COMMAND,
    "ppl": ppl.COMMAND,
    "ruler": ruler.COMMAND,
    "longbench": longbench.COMMAND,
    "pattern": mc.PATTERN,
    "report": Command(ReportConfig, _run_report),
    "calibrate": Command(CalibrateConfig, run_calibrate),
}


def reports() -> list[Report]:
    """The report of each kind of result, in ``COMMANDS``' order (mc and matched share one)."""
    out: dict[str, Report] = {}
    for command in COMMANDS.values():
        if command.report is not None:
            out.setdefault(command.report.kind, command.report)
    return list(out.values())


def run_eval(cfg: Any, load: Any = None) -> Any:
    """The command of ``cfg``'s type; for one that stores results (an ``EvalOutput``), then
    results.md and the plots of its folder."""
    from kvgate.eval.commands import EvalOutput
    from kvgate.eval.report import markdown_table, write_outputs

    command = next((c for c in COMMANDS.values() if c.config is type(cfg)), None)
    if command is None:
        raise EvalError(f"no eval command takes a {type(cfg).__name__}")
    output = command.run(cfg, load)
    if isinstance(output, EvalOutput):
        shown = reports()
        output.paths = [*write_outputs(output.store, shown), *output.paths]
        output.markdown = markdown_table(output.store.complete_results(), shown)
    return output
