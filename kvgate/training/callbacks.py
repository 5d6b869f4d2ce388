"""The callback that exports the gated checkpoint at the end of fit (``ExportGated``, named by
class path in run configs); the ones every run has live in ``kvgate.training.monitors`` and
are importable from here too."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from kvgate.training.errors import warn
from kvgate.training.export import export_module
from kvgate.training.monitors import (  # noqa: F401  (importable from here, as before)
    EvictionImageLogger,
    TokensPerSecond,
    default_callbacks,
    retention_figure,
    token_flags_figure,
)


class ExportGated(Callback):
    """At the end of ``fit``, writes the gated checkpoint (``kvgate.checkpoint`` format) to
    ``dirpath`` (default ``<log_dir>/gated``) from rank 0; a run that did no optimiser step
    exports nothing (one warning line)."""

    def __init__(self, dirpath: str | None = None, merge: bool = False) -> None:
        self.dirpath = dirpath
        self.merge = merge
        self.written: Path | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.interrupted:
            return
        if trainer.global_step == 0:  # the export would be the untrained initial gates
            warn("ExportGated: the run did no training step (global step 0): nothing exported")
            return
        if "deepspeed" in type(trainer.strategy).__name__.lower() \
                and getattr(trainer.strategy, "zero_stage_3", False):
            rank_zero_warn("ExportGated: ZeRO-3 shards the parameters; export from the "
                           "consolidated checkpoint with `kvgate export` instead")
            return
        # every rank asks for log_dir: under DDP it is a collective (a broadcast)
        out = Path(self.dirpath) if self.dirpath else \
            Path(trainer.log_dir or trainer.default_root_dir) / "gated"
        self._export(trainer, pl_module, out)

    @rank_zero_only
    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Path) -> None:
        self.written = export_module(pl_module, out, merge=self.merge, overwrite=True,
                                     global_step=trainer.global_step)
