"""DeepSpeed on the CPU, for checking a ZeRO config before it goes to a GPU job.

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA, although DeepSpeed itself
runs ZeRO-1/2 on the CPU with its ``cpu`` accelerator and the gloo backend. A ZeRO config that
is wrong (frozen parameters in the optimiser, a checkpoint that cannot be consolidated, an
export that misses the gates) otherwise fails only after a GPU queue. This strategy lifts the
CUDA check and nothing else, so the same module, data, checkpoints and export run here:

    python train.py --config cpt_demo --trainer.max_steps 3 --trainer.strategy deepspeed_cpu

It is a correctness tool, not a fast path: on the CPU it is slower than plain training.
"""

from __future__ import annotations

import importlib
import os

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

from kvgate.training.errors import TrainingConfigError


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that runs on ``accelerator: cpu`` (gloo, ZeRO stage 1 or 2)."""

    strategy_name = "deepspeed_cpu"

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        kwargs.setdefault("stage", 2)
        kwargs.setdefault("exclude_frozen_parameters", True)  # no frozen base in checkpoints
        # "auto" would build the train loader before the model (and its tokenizer) exists; the
        # value only feeds DeepSpeed's throughput log, Lightning feeds the batches itself
        kwargs.setdefault("logging_batch_size_per_gpu", 1)
        # DeepSpeed picks its accelerator once, at import: name it before anything imports it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().__init__(*args, **kwargs)
        stage = self.config.get("zero_optimization", {}).get("stage", 0)
        if stage not in (0, 1, 2):
            # ZeRO-3 partitions parameters through CUDA-only hooks in DeepSpeed's CPU build
            raise TrainingConfigError(
                f"CPUDeepSpeedStrategy: ZeRO stage {stage} is not supported on the CPU "
                "(use stage 1 or 2 here, stage 3 on GPUs with DeepSpeedStrategy)")

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            raise TrainingConfigError(
                "CPUDeepSpeedStrategy needs trainer.accelerator: cpu; on GPUs use "
                "lightning.pytorch.strategies.DeepSpeedStrategy")
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise TrainingConfigError(
                "CPUDeepSpeedStrategy: DeepSpeed was imported with a non-CPU accelerator; "
                "set DS_ACCELERATOR=cpu before starting Python")
        # skip DeepSpeedStrategy's CUDA check, keep the rest of the parallel set-up
        super(DeepSpeedStrategy, self).setup_environment()

    @property
    def root_device(self) -> torch.device:
        # DeepSpeed reads the device index as the rank's device number; a bare "cpu" has none
        return torch.device("cpu", self.local_rank)

    def setup_distributed(self) -> None:
        # DeepSpeedStrategy checks CUDA device indices here; CPU devices have none
        reset_seed()
        self.set_world_ranks()
        _skip_shm_comm_build()
        self._init_deepspeed_distributed()


def _skip_shm_comm_build() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed JIT-builds ``deepspeed_shm_comm`` with g++ and ninja when
    its comm backend starts. That needs a compiler, took about a minute here, and waits forever
    on the lock a killed build leaves in ``TORCH_EXTENSIONS_DIR``; a CI run timed out there.
    The op only speeds up intra-node reductions, which gloo does correctly without it, and
    this strategy exists to check correctness.
    """
    # by module path: the ``deepspeed.comm`` package re-exports the real ``torch`` under that name
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None


if "deepspeed_cpu" not in StrategyRegistry:
    StrategyRegistry.register(
        "deepspeed_cpu", CPUDeepSpeedStrategy,
        description="DeepSpeed ZeRO-2 on the CPU (gloo) for checking a config before a GPU job")
