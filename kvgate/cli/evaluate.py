"""``kvgate eval COMMAND ...``: the evaluation commands mounted under ``kvgate``. Their flags
are in :mod:`kvgate.eval.flags` (shared with ``python -m kvgate.eval``), their typed configs
in :mod:`kvgate.eval.config`, the functions that run them in :mod:`kvgate.eval.commands`."""

from __future__ import annotations

import argparse

from kvgate.eval import flags


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="accuracy, retrieval and perplexity under eviction "
                       f"({', '.join(flags.CONFIGS)})", description=flags.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_commands(p)
    p.set_defaults(run=flags.run_args)
    return p
