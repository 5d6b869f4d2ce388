"""Training's progress: Lightning's progress bar as kvgate's one display (``kvgate.progress``).

Lightning's own bar (``RichProgressBar`` where ``rich`` is installed, else ``TQDMProgressBar``)
counts the batches of each epoch, draws a second bar for every validation and, in a log file,
leaves hundreds of redraws. A run of
``kvgate train`` shows :class:`StepProgress` instead: optimiser steps done of the run's total
(``trainer.estimated_stepping_batches``: ``max_steps``, or ``max_epochs``' batches over the
gradient accumulation), elapsed and time left (validation's time included in the steps'), the
progress-bar metrics the module logs (``train/lm_loss``, ``evict%``, ``val/lm_loss``, ...) beside
it; a bar on a terminal, a line a step elsewhere (at most one every few seconds), only on rank
0. A resumed run counts from its checkpoint's step. :func:`use_step_progress` puts it in place.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from kvgate.progress import Progress


class StepProgress(ProgressBar):
    """Optimiser steps of a training run in the one progress display (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True
        self.bar: Progress | None = None
        self.seen = 0

    def disable(self) -> None:
        self.enabled = False  # Lightning's call on every rank but 0

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        if not self.enabled or not math.isfinite(total):  # no step limit: nothing to count to
            return
        self.seen = trainer.global_step
        self.bar = Progress(int(total), "training", "step", done=self.seen)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.bar is not None and trainer.global_step > self.seen:
            self.bar.advance(trainer.global_step - self.seen, self.metrics(trainer, pl_module))
            self.seen = trainer.global_step

    def metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """The logged progress-bar metrics, ``train/lm_loss 3.214, evict% 41.2``."""
        shown = self.get_metrics(trainer, pl_module)
        shown.pop("v_num", None)
        return ", ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                         for name, value in shown.items())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self.close()


def use_step_progress(trainer: L.Trainer, quiet: bool = False) -> None:
    """Lightning's default bar on ``trainer`` (its rich or tqdm one) replaced by
    :class:`StepProgress`. A bar of another class the config chose itself is kept, and a
    trainer without one (``trainer.enable_progress_bar: false``) stays without; ``quiet``
    (``kvgate train --quiet``) removes any."""
    bars = [c for c in trainer.callbacks if isinstance(c, ProgressBar)]
    if quiet:
        trainer.callbacks = [c for c in trainer.callbacks if c not in bars]
    elif bars and type(bars[0]) in (RichProgressBar, TQDMProgressBar):
        trainer.callbacks[trainer.callbacks.index(bars[0])] = StepProgress()
