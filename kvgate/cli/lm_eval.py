"""``python -m kvgate.integrations.lm_eval <lm-eval's own arguments>`` (the shim
:mod:`kvgate.integrations.lm_eval.__main__` runs this module's ``main``): lm-eval's command line
with the ``kvgate`` model registered and kvgate's offline tasks on the include path.

Every argument goes to lm-eval unchanged; ``--include_path <the shipped tasks>`` is added
unless given (lm-eval takes one include path: with your own, name kvgate's tasks by their YAML
files instead). When every task asked for is one of kvgate's, the hub is switched off
(HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) before lm-eval is imported, so nothing waits on it.
"""

from __future__ import annotations

import os
import sys

from kvgate.cli.common import EXIT_USAGE, find_cause, first_line
from kvgate.integrations.lm_eval import TASK_NAMES, TASKS_DIR, register

_SUBCOMMANDS_WITH_TASKS = ("run", "ls", "validate")
_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` in ``argv`` (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def prepare(argv: list[str]) -> list[str]:
    """lm-eval's argument list with the include path added, the hub switched off when only
    kvgate's tasks run (a change of ``os.environ``)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        return argv
    if argv[0].startswith("-") or argv[0] in _SUBCOMMANDS_WITH_TASKS:
        given = _option(argv, "--include_path")
        if given is None:
            argv += ["--include_path", str(TASKS_DIR)]
        elif os.path.abspath(given) != str(TASKS_DIR):
            print(f"kvgate: --include_path {given} replaces kvgate's tasks folder; name "
                  f"kvgate's tasks by file: {TASKS_DIR}/<task>.yaml", file=sys.stderr)
    tasks = [t for t in (_option(argv, "--tasks") or "").split(",") if t]
    if tasks and all(t in TASK_NAMES for t in tasks):
        for var in _OFFLINE:
            os.environ.setdefault(var, "1")
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = prepare(sys.argv[1:] if argv is None else argv)
    register()  # after the offline switches: importing lm-eval reads them
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except Exception as err:  # only our own errors become one line; others keep their trace
        cause = find_cause(err)
        if cause is None:
            raise
        print(f"error: {first_line(cause)}", file=sys.stderr)
        return EXIT_USAGE
    return 0
