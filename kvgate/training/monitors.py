"""The callbacks every KVGateModule run has (``default_callbacks``, returned by the module's
``configure_callbacks``): tokens/s, eviction-pattern images, a stop at the first non-finite
value and (from ``kvgate.training.integrity``) the sha256 sidecars of Lightning checkpoints.

Kept apart from ``callbacks`` (the export at the end of fit): the module imports this one, and
the export imports the module, so the two could not share a file without an import circle."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from torch import Tensor

from kvgate.training.finite import StopOnNonFinite
from kvgate.training.integrity import ChecksumCheckpoints


class TokensPerSecond(Callback):
    """Logs ``perf/tokens_per_s``: real (non-padding) tokens of all ranks per wall second,
    averaged since the first step (which is excluded: it pays for warm-up and allocation).

    The interval between consecutive batch ends covers the whole step (data, forward,
    backward, optimiser) without a device synchronisation per step.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self._last: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.tokens += int(batch["attention_mask"].sum()) * trainer.world_size
            self.seconds += now - self._last
            pl_module.log("perf/tokens_per_s", self.tokens_per_s, batch_size=1, rank_zero_only=True)
        self._last = now

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation time is not training time


def _heat_map(data, width: float, cmap: str, xlabel: str, title: str, **imshow):
    """A [layers, columns] map in [0, 1] with a colour bar; layers down the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.22 * data.shape[0]))
    im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap=cmap, aspect="auto", **imshow)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def retention_figure(per_head: Tensor):
    """Heat map of retention [L, H_gate] (rows = layers, columns = gated heads)."""
    data = per_head.detach().float().cpu().numpy()
    return _heat_map(data, max(3.5, 1.5 + 0.5 * data.shape[1]), "viridis", "gated head",
                     "retention (1 = keep)")


def token_flags_figure(flags: Tensor, counted: Tensor | None = None):
    """Keep flags of one sample, tokens x layers (the paper's Figure 1 view): ``flags``
    [L, H_gate, n] -> image [L, n] of the share of heads that keep each token."""
    data = flags.detach().float().mean(1)
    if counted is not None:
        data = data[:, counted.bool()]
    data = data.cpu().numpy()
    return _heat_map(data, min(16.0, 2.0 + 0.04 * data.shape[1]), "gray", "token",
                     "kept share of heads per token (white = kept)", interpolation="nearest")


class EvictionImageLogger(Callback):
    """Every ``every_n_steps`` optimiser steps, draws retention per layer x head and the
    tokens x layers flags of the batch's first sample into TensorBoard."""

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = every_n_steps
        self._step = 0  # the optimiser step whose flags are being captured

    def _due(self, trainer: L.Trainer) -> bool:
        return self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._due(trainer) and trainer.is_global_zero:
            pl_module.capture_flags = True
            self._step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        flags = getattr(pl_module, "last_flags", None)
        if flags is None or not trainer.is_global_zero:
            return
        pl_module.last_flags = None
        per_head = pl_module.last_stats.get("retention_per_head")
        figures = {"eviction/tokens_x_layers": token_flags_figure(flags, pl_module.last_counted)}
        if per_head is not None:
            figures["eviction/layers_x_heads"] = retention_figure(per_head)
        self._write(trainer, figures, self._step)

    @staticmethod
    def _write(trainer: L.Trainer, figures: dict[str, Any], step: int) -> None:
        import matplotlib.pyplot as plt

        for logger in trainer.loggers:
            add_figure = getattr(getattr(logger, "experiment", None), "add_figure", None)
            if callable(add_figure):
                for tag, fig in figures.items():
                    add_figure(tag, fig, global_step=step, close=False)
        for fig in figures.values():
            plt.close(fig)


def default_callbacks(module: L.LightningModule) -> list[Callback]:
    """What every KVGateModule run has: sha256 sidecars for its checkpoints, a stop at the
    first non-finite loss or tensor, and the logs of tokens/s, learning rates and eviction
    images."""
    callbacks: list[Callback] = [ChecksumCheckpoints(), StopOnNonFinite(), TokensPerSecond()]
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and trainer.loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if getattr(module, "gated", False) and module.image_every_n_steps > 0:
        callbacks.append(EvictionImageLogger(module.image_every_n_steps))
    return callbacks
