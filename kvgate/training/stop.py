"""SIGTERM / SIGINT during training: stop after the current step, with a checkpoint to resume.

Lightning turns SIGTERM into a ``SIGTERMException`` raised at the end of a training step, a
``SystemExit`` with no status, so a killed ``kvgate train`` used to exit 0 two seconds later
with no checkpoint of where it stopped, and a wrapper script saw success. Ctrl-C raised
``KeyboardInterrupt`` wherever the code was, mid-step included.

``GracefulStop`` handles both the same way: its handler only records the signal and raises
Lightning's flag (``trainer.received_sigterm``), so the loop stops at the next step's end, a
safe point (the optimiser step, the data position and the step checkpoints all agree there).
Its ``on_exception`` then writes ``stopped.ckpt`` (sidecar included) into the run's checkpoint
folder, where ``--ckpt_path last`` finds it; ``kvgate train`` prints one line and exits
128 + the signal's number (143 for SIGTERM, 130 for SIGINT). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from kvgate.training.integrity import checkpoint_folders

__all__ = ["STOPPED_NAME", "GracefulStop", "SIGTERMException"]

STOPPED_NAME = "stopped.ckpt"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop(Callback):
    """``install(trainer)`` before ``fit``, ``uninstall()`` after (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the signal that asked for the stop
        self.saved: Path | None = None  # the checkpoint written at the stop
        self.step: int | None = None
        self._trainer: Any = None
        self._old: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by the signal: 128 + its number."""
        return 128 + int(self.signum or signal.SIGTERM)

    def install(self, trainer: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread; Lightning's SIGTERM stays
        self._trainer = trainer
        for signum in _SIGNALS:
            self._old[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait
        self.signum = signum
        self._raise_flag()

    def _raise_flag(self) -> None:
        connector = getattr(self._trainer, "_signal_connector", None)
        if connector is not None:  # what trainer.received_sigterm reads; the loops check it
            connector.received_sigterm = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning clears its flag when fit registers its own handlers: a signal that came
        # while the base loaded must still stop the run
        if self.signum is not None:
            self._raise_flag()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.signum is None or not isinstance(exception, SIGTERMException):
            return
        folders, _ = checkpoint_folders(trainer)
        folder = folders[0] if folders else Path(trainer.default_root_dir) / "checkpoints"
        self.step = trainer.global_step
        self.saved = folder / STOPPED_NAME
        trainer.save_checkpoint(self.saved)  # through the strategy: its sidecar too
