"""Training: the LightningModule, data modules, callbacks, LoRA wiring and export (see train.py).

Layout: ``module`` (the LightningModule), ``objective`` (the loss of one batch), ``build``
(base + LoRA + gates), ``optim`` (AdamW and its schedule), ``data`` (CPT and SFT data modules)
on ``datamodule`` (resumable order, loaders) and ``batches`` (the batch contract),
``monitors`` (the callbacks every run has), ``callbacks`` (the export at fit's end),
``export`` (to the gated-checkpoint format), ``lora``, ``strategies``; a run's safety:
``integrity`` (checkpoint sidecars), ``runlock``, ``start`` (what a run may start from) and
``stop`` (SIGTERM / SIGINT at a step's end, with a checkpoint).
"""

from kvgate.training.callbacks import ExportGated
from kvgate.training.data import CPTDataModule, KVGateDataModule, ResumableSampler, SFTDataModule
from kvgate.training.errors import TrainingConfigError
from kvgate.training.export import export_checkpoint, export_module, module_from_checkpoint
from kvgate.training.lora import LoraSettings
from kvgate.training.module import KVGateModule, OptimSettings
from kvgate.training.monitors import EvictionImageLogger, TokensPerSecond

__all__ = [
    "CPTDataModule", "EvictionImageLogger", "ExportGated", "KVGateDataModule", "KVGateModule",
    "LoraSettings", "OptimSettings", "ResumableSampler", "SFTDataModule", "TokensPerSecond",
    "TrainingConfigError", "export_checkpoint", "export_module", "module_from_checkpoint",
]
