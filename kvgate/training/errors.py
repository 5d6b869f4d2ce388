"""Errors of the training side; each message names the offending key or file. ``warn`` prints
the one-line notes a run gives when it goes on (a lock taken over, a checkpoint not verified)."""

from __future__ import annotations

import os
import sys

from kvgate.errors import KVGateError


class TrainingConfigError(KVGateError, ValueError):
    """A training setting is invalid or unusable on this machine; the message names the key."""


class RunInUseError(KVGateError, RuntimeError):
    """Another live run holds the run folder's lock (``kvgate.training.runlock``)."""


def launch_rank() -> int:
    """This process's rank as its launcher set it (0 when launched alone): DDP's children,
    torchrun and SLURM tasks each run the whole command, but only rank 0 speaks or locks."""
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "0")
        if value.isdigit() and int(value) != 0:
            return int(value)
    return 0


def warn(message: str) -> None:
    """``warning: <message>`` as one line on stderr, from rank 0 only."""
    if launch_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A one-line note on stderr (what a run resumes from), from rank 0 only."""
    if launch_rank() == 0:
        print(message, file=sys.stderr, flush=True)
