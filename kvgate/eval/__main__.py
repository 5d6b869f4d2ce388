"""``python -m kvgate.eval ...``: the same command as ``kvgate eval ...`` (the flags are in
:mod:`kvgate.eval.flags`). A user error prints ``error: <first line>`` and exits 2, as in
``kvgate.cli``; ``--debug`` shows the traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvgate.errors import KVGateError
from kvgate.eval.commands import load_model
from kvgate.eval.config import parse_policies
from kvgate.eval.flags import build_parser, run_args

__all__ = ["load_model", "main", "parse_policies"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser("python -m kvgate.eval").parse_args(None if argv is None else list(argv))
    try:
        # load_model is looked up here when the command runs: tests replace it on this module
        return run_args(args, load=lambda cfg: load_model(cfg))
    except KVGateError as exc:
        if getattr(args, "debug", False):
            raise
        text = str(exc).strip()
        print(f"error: {text.splitlines()[0] if text else type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
