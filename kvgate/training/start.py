"""What a run may start from, checked before ``fit`` builds anything or writes a log folder.

- A run folder that already holds checkpoints, started without ``--ckpt_path``: refused (the
  run would start at step 0 and write ``*-v1.ckpt`` beside a killed run's files, and a later
  ``--ckpt_path last`` could pick either), unless ``--overwrite`` says to replace them.
- A resume checkpoint written with other gate or LoRA shapes than this run's config: refused
  naming the field, instead of a size-mismatch traceback deep inside Lightning's restore.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from kvgate.checkpoint import CheckpointError
from kvgate.gate import GateConfig
from kvgate.training.errors import TrainingConfigError, note
from kvgate.training.integrity import SIDECAR_SUFFIX, checkpoint_folders, load_mmap

__all__ = ["check_fresh_start", "check_resume_fits", "earlier_checkpoints",
           "remove_earlier_checkpoints"]

# the settings that decide which trained tensors exist and their shapes, by hparams path: these,
# then the shapes of the run's gate kind (its settings' ``shapes``: the attention kind's heads
# and head_dim, the mlp kind's hidden)
_GATE_SHAPES = ("kind", "target")
_LORA_SHAPES = ("rank", "targets")


def earlier_checkpoints(trainer: Any) -> list[Path]:
    """The checkpoint files a run into this trainer's folders would find there already."""
    folders, files = checkpoint_folders(trainer)
    found = [p for p in files if p.exists()]
    for folder in folders:
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.suffix == ".ckpt"]
    return sorted(set(found))


def check_fresh_start(trainer: Any, overwrite: bool) -> list[Path]:
    """A run without ``--ckpt_path``: ``TrainingConfigError`` when its checkpoint folder holds
    an earlier run's checkpoints and ``overwrite`` is False. Returns those checkpoints (for
    ``remove_earlier_checkpoints`` once the run is about to start)."""
    found = earlier_checkpoints(trainer)
    if found and not overwrite:
        raise TrainingConfigError(
            f"{found[0].parent} already holds {len(found)} checkpoint(s) of an earlier run: "
            "resume it with --ckpt_path last, or start afresh with a new --run_dir "
            "(--overwrite deletes those checkpoints and starts at step 0)")
    return found


def remove_earlier_checkpoints(found: list[Path]) -> None:
    """Delete an earlier run's checkpoints (and their sidecars) for ``--overwrite``."""
    for path in found:
        if path.is_dir() and not path.is_symlink():  # a DeepSpeed checkpoint folder
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        Path(f"{os.fspath(path)}{SIDECAR_SUFFIX}").unlink(missing_ok=True)
    if found:
        note(f"--overwrite: deleted {len(found)} checkpoint(s) of an earlier run in "
             f"{found[0].parent}; starting at step 0")


def _field(hparams: dict[str, Any], group: str, key: str) -> Any:
    part = hparams.get(group)
    return part.get(key) if isinstance(part, dict) else None


def check_resume_fits(ckpt_path: str | os.PathLike, module: Any) -> None:
    """``TrainingConfigError`` naming the first setting (``model.train``, ``model.gate.heads``,
    ``model.lora.rank``, ...) in which the checkpoint's run and this one differ such that its
    trained tensors cannot be loaded here. A DeepSpeed folder is left to Lightning."""
    path = Path(ckpt_path)
    if path.is_dir():
        return
    ckpt = load_mmap(path)
    saved = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: not a KVGateModule checkpoint (no hyper_parameters)")
    mine = dict(module.hparams)
    checks = [("train",)]
    if mine.get("train") in ("gates", "gates_lora"):
        shapes = module.gate_cfg.kind_settings().shapes
        checks += [("gate", key) for key in (*_GATE_SHAPES, *shapes)]
    if mine.get("train") in ("gates_lora", "lora"):
        checks += [("lora", key) for key in _LORA_SHAPES]
    for names in checks:
        if len(names) == 1:
            was, now = saved.get(names[0]), mine.get(names[0])
        else:
            was, now = _field(saved, *names), _field(mine, *names)
        if names[0] == "gate" and was is None and names[1] in GateConfig.__dataclass_fields__:
            # written before the setting existed (kind, hidden): it ran with today's default
            was = GateConfig.__dataclass_fields__[names[1]].default
        if "head_dim" in names and None in (was, now):
            continue  # None is the model's own head_dim: equal or not, only the model knows
        if was != now:
            flag = "model." + ".".join(names)
            raise TrainingConfigError(
                f"--ckpt_path {path}: written by a run with {flag} {was!r}, this run has "
                f"{now!r}, so its trained tensors do not fit; resume with {flag} {was!r}, or "
                "start afresh in a new --run_dir without --ckpt_path")
