"""Training: the LightningModule, data modules, callbacks and LoRA wiring (see train.py)."""

from kvgate.training.callbacks import EvictionImageLogger, ExportGated, TokensPerSecond
from kvgate.training.data import CPTDataModule, KVGateDataModule, ResumableSampler, SFTDataModule
from kvgate.training.errors import TrainingConfigError
from kvgate.training.lora import LoraSettings
from kvgate.training.module import KVGateModule, OptimSettings

__all__ = [
    "CPTDataModule", "EvictionImageLogger", "ExportGated", "KVGateDataModule", "KVGateModule",
    "LoraSettings", "OptimSettings", "ResumableSampler", "SFTDataModule", "TokensPerSecond",
    "TrainingConfigError",
]
