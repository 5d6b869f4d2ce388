"""``kvgate``: the one command line of the package.

    kvgate train --config cpt_recipe [--trainer.max_steps 20 ...]   # = python train.py ...
    kvgate infer --model smollm2-135m --policy snapkv --budget 0.5 --prompt "Hello"
    kvgate eval mc --model smollm2-135m --tasks rte,copa --budgets 0.5 --out out/x
    kvgate export runs/cpt_demo/checkpoints/last.ckpt out/gated
    kvgate prepare smollm2-135m        # one-time conversion of an embedded GGUF model
    kvgate data                        # build the CPT corpus once and print its mix
    kvgate data oracle --config cpt_oracle   # the base's KVzip labels of a config's blocks

``kvgate COMMAND --help`` shows a command's options. A mistake the user can fix (a bad name,
value, file, model or setting: any ``kvgate.errors.KVGateError``) prints ``error: <first
line>`` on stderr and exits 2; ``--debug`` shows its traceback instead. Ctrl-C in any command
prints ``interrupted: kvgate COMMAND; <what was kept>`` and exits 130: what was finished
(stored eval results, label shards, checkpoints) stays where a rerun of the same command
continues from it.

Python: ``import kvgate`` (``kvgate.load_base``, ``kvgate.Engine``, ``kvgate.get_policy``, ...).
"""

# Each command lives in one module here (train, infer, export, tools for prepare and data,
# evaluate, which mounts the flags of kvgate.eval.flags so that `python -m kvgate.eval` shares
# them without importing this top layer); heavy imports wait until a command runs, so --help
# is quick.

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kvgate.errors import KVGateError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process Ctrl-C ended

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "build_parser", "first_line", "interrupted",
           "main", "run_cli"]

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


def build_parser() -> argparse.ArgumentParser:
    from kvgate.cli import evaluate, export, infer, tools
    from kvgate.eval.options import plain

    p = argparse.ArgumentParser(prog="kvgate", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvgate {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # train's options are Lightning's (parsed by LightningCLI): listed here, run by main()
    sub.add_parser("train", add_help=False, help="train Attention-Gates and/or LoRA "
                   "(LightningCLI: kvgate train --config NAME [--key value ...])")
    infer.add_parser(sub)
    evaluate.add_parser(sub)
    export.add_parser(sub)
    tools.add_prepare_parser(sub)
    tools.add_data_parser(sub)
    return p


def _version() -> str:
    from kvgate import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # every option after it belongs to LightningCLI
        # a first Ctrl-C stops training at a step (kvgate.training.stop); this catches one
        # while the run is set up, or a second one that does not wait for the step
        try:
            from kvgate.cli.train import main as train_main

            return train_main(argv[1:], prog="kvgate train")
        except KeyboardInterrupt:
            if "--debug" in argv:
                raise
            return interrupted("train")
    args = build_parser().parse_args(argv)
    return run_cli(args.run, args)


if __name__ == "__main__":
    sys.exit(main())
