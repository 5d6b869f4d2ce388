"""What every kvgate command line shares: user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Error types that are the user's to fix (bad name, budget, option, file, model)."""
    from kvgate.cache import CacheError
    from kvgate.checkpoint import CheckpointError
    from kvgate.data.errors import DataError
    from kvgate.gate.config import ConfigError
    from kvgate.models.errors import ModelLoadError
    from kvgate.policies.base import PolicyError

    return (PolicyError, CacheError, DataError, ModelLoadError, ConfigError, CheckpointError)


def run_cli(run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
            extra: tuple[type[BaseException], ...] = ()) -> int:
    """``run(args)``; a known user error becomes ``error: <first line>`` on stderr and exit 2
    (``--debug`` re-raises it with its traceback)."""
    try:
        return run(args)
    except user_errors() + extra as exc:
        if getattr(args, "debug", False):
            raise
        text = str(exc).strip()
        print(f"error: {text.splitlines()[0] if text else type(exc).__name__}", file=sys.stderr)
        return EXIT_USAGE
