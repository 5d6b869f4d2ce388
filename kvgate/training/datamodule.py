"""The data-module machinery shared by CPT and SFT: tokenizer lookup, loaders, and a data
position that survives a resume.

Data position: the training order is a seeded permutation per epoch (``ResumableSampler``),
and the data module counts the batches the model has consumed in its ``state_dict``, which
Lightning stores in every checkpoint. On ``--ckpt_path last`` the sampler skips exactly those
batches, so a resumed run sees the same sequence of batches as an uninterrupted one.

The tokenizer comes from the model (``KVGateModule.get_tokenizer``: the one ``configure_model``
loaded, or the tokenizer alone when a strategy asks for the loaders first, as DeepSpeed does):
datasets are built lazily in ``train_dataloader``/``val_dataloader``. Outside a Trainer, set
``datamodule.tokenizer`` yourself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from kvgate.training.errors import TrainingConfigError


class ResumableSampler(DistributedSampler):
    """A seeded, epoch-dependent permutation sharded over ranks that can skip the first
    ``k`` samples of one epoch (the part of it a checkpoint already consumed).

    Subclassing ``DistributedSampler`` keeps Lightning from replacing it under DDP; rank and
    world size are passed explicitly so it also works without a process group.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
        self._skip_epoch: int | None = None
        self._skip = 0

    def skip(self, epoch: int, samples: int) -> None:
        """Skip the first ``samples`` indices of this rank's order in ``epoch`` (once)."""
        self._skip_epoch, self._skip = epoch, max(0, samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self._skip_epoch == self.epoch:
            indices = indices[self._skip:]
            self._skip_epoch, self._skip = None, 0
        yield from indices


class ResumableLoader(DataLoader):
    """A DataLoader that reports its data module's position to Lightning's loop state
    (so Lightning knows the loader is resumable) and restores it the same way."""

    def __init__(self, *args, datamodule: KVGateDataModule, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._datamodule = datamodule

    def state_dict(self) -> dict[str, Any]:
        return self._datamodule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # idempotent with the data module's own restore: both set the same skip
        self._datamodule.load_state_dict(state)
        self._datamodule.apply_resume()


class KVGateDataModule(L.LightningDataModule):
    """Shared machinery: tokenizer lookup, seeded resumable order, loaders, data position."""

    def __init__(self, batch_size: int = 4, val_batch_size: int | None = None, seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise TrainingConfigError(f"data.batch_size: must be a positive integer (got {batch_size!r})")
        if val_batch_size is not None and val_batch_size < 1:
            raise TrainingConfigError(f"data.val_batch_size: must be >= 1 (got {val_batch_size!r})")
        if num_workers < 0:
            raise TrainingConfigError(f"data.num_workers: must be >= 0 (got {num_workers!r})")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = None  # set by hand, or taken from the attached LightningModule
        self._train: Dataset | None = None
        self._val: Dataset | None = None
        self._sampler: ResumableSampler | None = None
        # data position: batches of the current epoch the model has consumed
        self._pos_epoch = 0
        self._pos_batches = 0
        self._resume: tuple[int, int] | None = None

    # -- subclasses build these from token ids
    def build_train(self, tokenizer) -> Dataset:
        raise NotImplementedError

    def build_val(self, tokenizer) -> Dataset | None:
        return None

    def collate_train(self, pad_id: int) -> Callable:
        """A picklable collate function for training batches (workers may pickle it)."""
        raise NotImplementedError

    def collate_val(self, pad_id: int) -> Callable:
        return self.collate_train(pad_id)

    # -- tokenizer
    def get_tokenizer(self):
        if self.tokenizer is not None:
            return self.tokenizer
        module = self.trainer.lightning_module if self._trainer_attached() else None
        tok = module.get_tokenizer() if hasattr(module, "get_tokenizer") else None
        if tok is None:
            raise TrainingConfigError(
                "data: no tokenizer: attach the data module to a Trainer whose model is built, "
                "or set datamodule.tokenizer")
        return tok

    def _trainer_attached(self) -> bool:
        return getattr(self, "trainer", None) is not None

    def pad_id(self) -> int:
        tok = self.get_tokenizer()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return 0 if pad is None else int(pad)

    # -- loaders
    def train_dataset(self) -> Dataset:
        if self._train is None:
            self._train = self.build_train(self.get_tokenizer())
            if len(self._train) == 0:
                raise TrainingConfigError("data: the training set is empty after tokenisation")
        return self._train

    def val_dataset(self) -> Dataset | None:
        if self._val is None:
            self._val = self.build_val(self.get_tokenizer())
        return self._val

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        world, rank = (self.trainer.world_size, self.trainer.global_rank) \
            if self._trainer_attached() else (1, 0)
        self._sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=self.seed)
        self.apply_resume()
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=self._sampler,
                               collate_fn=self.collate_train(self.pad_id()),
                               num_workers=self.num_workers, datamodule=self)

    def apply_resume(self) -> None:
        """Make the sampler skip the batches a restored checkpoint already consumed."""
        if self._resume is not None and self._sampler is not None:
            epoch, batches = self._resume
            self._sampler.skip(epoch, batches * self.batch_size)
            self._resume = None

    def val_dataloader(self):
        dataset = self.val_dataset()
        if dataset is None or len(dataset) == 0:
            return []
        return DataLoader(dataset, batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=self.collate_val(self.pad_id()),
                          num_workers=self.num_workers)

    # -- data position
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # runs once per batch right before the training step (after any prefetching), so the
        # count equals the batches the model has consumed when a checkpoint is written
        if self._trainer_attached() and self.trainer.training:
            epoch = self.trainer.current_epoch
            if epoch != self._pos_epoch:
                self._pos_epoch, self._pos_batches = epoch, 0
            self._pos_batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._pos_epoch, "batches": self._pos_batches, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise TrainingConfigError(
                f"data.seed: the checkpoint's data order used seed {state['seed']}, this run "
                f"has {self.seed}; resume with the same seed")
        self._pos_epoch, self._pos_batches = int(state["epoch"]), int(state["batches"])
        self._resume = (self._pos_epoch, self._pos_batches)
