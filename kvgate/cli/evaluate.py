"""``kvgate eval COMMAND ...``: the evaluation commands mounted under ``kvgate``. Their flags
are written from their configs (:mod:`kvgate.eval.registry`) by :mod:`kvgate.eval.flags`
(shared with ``python -m kvgate.eval``)."""

from __future__ import annotations

import argparse

from kvgate.eval import flags


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from kvgate.eval.options import plain
    from kvgate.eval.registry import COMMANDS

    p = sub.add_parser("eval", help="accuracy, retrieval and perplexity under eviction "
                       f"({', '.join(COMMANDS)})", description=plain(flags.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_commands(p)
    p.set_defaults(run=flags.run_args)
    return p
