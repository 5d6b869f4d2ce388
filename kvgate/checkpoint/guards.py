"""Checks that keep a gated checkpoint from passing for something it is not: tensors that are
not finite (a diverged run's gates, which used to load and evict at random), and a path that
is a training checkpoint rather than an export (which used to read "no such checkpoint
folder" for a file that exists)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvgate.checkpoint.format import CONFIG_NAME, CheckpointError

__all__ = ["check_finite", "not_an_export"]


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """``CheckpointError`` ``"{where}: tensor NAME holds NaN ..."`` naming the first tensor of
    ``tensors`` with a NaN or an infinity; one reduction per tensor and a single host sync."""
    names = [k for k, v in tensors.items()
             if torch.is_tensor(v) and torch.is_floating_point(v) and v.numel()]
    if not names:
        return
    finite = torch.stack([torch.isfinite(tensors[k]).all().cpu() for k in names])
    if bool(finite.all()):
        return
    name = names[int((~finite).nonzero()[0, 0])]
    value = "NaN" if bool(torch.isnan(tensors[name]).any()) else "infinite"
    raise CheckpointError(f"{where}: tensor {name!r} holds {value} values (a diverged training "
                          "run: retrain with a lower learning rate, or use an earlier "
                          "checkpoint of the run)")


def _training_checkpoint(path: Path) -> bool:
    """A Lightning checkpoint file, or a DeepSpeed checkpoint folder, as ``kvgate train``
    writes them."""
    if path.is_file():
        return path.suffix == ".ckpt"
    return path.is_dir() and ((path / "latest").is_file() or (path / "checkpoint").is_dir())


def not_an_export(root: Path) -> CheckpointError:
    """Why ``root``, which holds no ``kvgate_config.json``, is no gated checkpoint, with the
    command that makes one when it is a training checkpoint."""
    if _training_checkpoint(root):
        return CheckpointError(
            f"{root}: a training checkpoint (written by kvgate train), not an exported gated "
            f"checkpoint folder; export it first with `kvgate export {root} OUT` and pass OUT")
    if root.is_file():
        return CheckpointError(f"{root}: a file, not a gated checkpoint folder")
    if root.is_dir():
        return CheckpointError(f"{root}: not a gated checkpoint ({CONFIG_NAME} is missing)")
    return CheckpointError(f"{root}: no such checkpoint folder")
