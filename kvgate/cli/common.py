"""What every kvgate command shares, written once: the one-line error (``first_line``), the
search of an error's chain for our own (``find_cause``), the line of a Ctrl-C (``interrupted``)
and ``run_cli``, which turns either into an exit status. Below ``kvgate.cli``'s own module, so
the command modules import it without importing the package's parser back."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvgate.errors import KVGateError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process Ctrl-C ended

# what a Ctrl-C leaves of each command: every writer below is atomic or resumable, so the line
# can promise it (eval: the store is written on the interrupt, kvgate.eval.commands)
_KEPT = {
    "train": "checkpoints written so far are kept; resume with --ckpt_path last",
    "infer": "nothing was written",
    "eval": "finished results are kept in {out}; rerun the same command to continue",
    "eval calibrate": "nothing was written (the calibration is written whole at the end); "
                      "rerun to calibrate",
    "eval report": "the results files are written whole; rerun to rewrite them",
    "export": "nothing half-written is kept (the next export removes its temporary folder); "
              "rerun to export",
    "prepare": "nothing half-written is kept; rerun to convert",
    "data": "the corpus is written whole or not at all; rerun to build it",
    "data oracle": "finished label shards are kept; rerun the same command to continue",
}


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def command_of(args: argparse.Namespace, default: str = "") -> str:
    """The command words of parsed ``kvgate`` arguments (``eval ruler``, ``data oracle``)."""
    words = [getattr(args, name, None) for name in ("command", "eval_command", "data_command")]
    return " ".join(w for w in words if w) or default


def interrupted(command: str, out: str | None = None) -> int:
    """The one line of a Ctrl-C in ``kvgate COMMAND`` (what was kept, how to go on) on stderr;
    returns the exit status, 130."""
    kept = _KEPT.get(command) or _KEPT.get(command.split(" ")[0], "rerun to continue")
    print(f"interrupted: kvgate {command}; {kept.format(out=out or 'the output folder')}",
          file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def run_cli(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``; a ``KVGateError`` becomes ``error: <first line>`` on stderr and exit 2,
    a Ctrl-C the line of :func:`interrupted` and exit 130 (``args.debug`` re-raises either
    with its traceback)."""
    debug = getattr(args, "debug", False)
    try:
        return run(args)
    except KVGateError as exc:
        if debug:
            raise
        print(f"error: {first_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if debug:
            raise
        # a standalone parser (python infer.py, kvgate.cli.export.main) has no command words:
        # the command is the module of kvgate.cli that runs it
        command = command_of(args, getattr(run, "__module__", "").rpartition(".")[2])
        return interrupted(command, getattr(args, "out", None))


def find_cause(err: BaseException | None,
               types: tuple[type, ...] = (KVGateError,)) -> BaseException | None:
    """The first error of ``types`` in ``err``'s chain, ``err`` included (jsonargparse and
    lm-eval re-raise ours wrapped), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, types):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
