"""Lightning checkpoints a run can trust: a sha256 sidecar with each, the newest valid one for
``--ckpt_path last``.

Every checkpoint file a ``KVGateModule`` run writes (``ModelCheckpoint``, ``last.ckpt``,
``OnExceptionCheckpoint``, ``trainer.save_checkpoint``) gets ``NAME.ckpt.sha256`` beside it, in
``sha256sum``'s format (``sha256sum -c`` checks it too): ``ChecksumCheckpoints`` (one of the
module's default callbacks) swaps the strategy's ``TorchCheckpointIO`` for
``ChecksummedCheckpointIO``, which removes the old sidecar before a save, writes the new one
atomically (temporary file + rename) after it, and removes it with its checkpoint. A kill
between the two leaves a checkpoint without a sidecar, never one with a stale sidecar.

``verify_checkpoint`` (resume and export) refuses a file whose sha256 does not match its
sidecar; a checkpoint without sidecar (older runs, or a kill right after the save) is accepted
with one warning line. The damaged files ``--ckpt_path last`` skips are renamed
``NAME.damaged`` once the run resumes (``set_aside``), so its saves take their names; an export
refused for a damaged file names the valid checkpoint beside it (``better_checkpoint``). DeepSpeed checkpoints are folders written by DeepSpeed itself: they get
no sidecar and are not verified.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from kvgate.checkpoint import CheckpointError, sha256_file
from kvgate.training.errors import launch_rank, note, warn

__all__ = ["SIDECAR_SUFFIX", "ChecksumCheckpoints", "ChecksummedCheckpointIO", "better_checkpoint",
           "brief_error", "checkpoint_folders", "checkpoint_step", "load_mmap",
           "newest_checkpoint", "resume_path", "set_aside", "sidecar_path", "verify_checkpoint",
           "warn_unverified", "write_sidecar"]

SIDECAR_SUFFIX = ".sha256"
_WARNED: set[str] = set()  # checkpoints already reported as unverified (one line each)


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{SIDECAR_SUFFIX}")


def _local(path: str | os.PathLike) -> bool:
    return "://" not in os.fspath(path) or os.fspath(path).startswith("file://")


def write_sidecar(path: str | os.PathLike) -> Path:
    """Write ``path``'s sha256 to ``path.sha256`` atomically; returns the sidecar."""
    path = Path(path)
    side = sidecar_path(path)
    tmp = side.with_name(f".{side.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{sha256_file(path)}  {path.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, side)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return side


def warn_unverified(path: str | os.PathLike) -> None:
    """The one warning line (once per file and process) for a checkpoint without sidecar."""
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warn(f"{path}: no sidecar {sidecar_path(path).name} with its sha256 (a checkpoint of "
             "an older run, or a kill right after the save): used unverified")


def verify_checkpoint(path: str | os.PathLike, warn_missing: bool = True) -> bool:
    """``CheckpointError`` naming the file when ``path`` is missing or does not match its
    sidecar (or the sidecar is unreadable). False when it has no sidecar (and, with
    ``warn_missing``, one warning line; callers that read the file next warn after reading,
    so that a damaged file gets its error alone)."""
    path = Path(path)
    if path.is_dir():
        return False  # a DeepSpeed checkpoint folder: not checksummed
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    # save_last="link": last.ckpt is a symlink to a step checkpoint, whose sidecar counts
    side = sidecar_path(path.resolve() if path.is_symlink() else path)
    if not side.exists():
        if warn_missing:
            warn_unverified(path)
        return False
    try:
        want = side.read_text(encoding="utf-8").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        raise CheckpointError(f"{side}: unreadable checksum sidecar of {path.name}") from None
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        raise CheckpointError(f"{side}: not a sha256 line; delete it to use {path.name} unverified")
    if sha256_file(path) != want:
        raise CheckpointError(f"{path}: corrupt (its sha256 does not match {side.name})")
    return True


def load_mmap(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # the legacy format


def brief_error(err: BaseException) -> str:
    """The first sentence of an error's first line (torch's read errors run on)."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text.split(". ")[0]


def checkpoint_step(path: str | os.PathLike, warn_missing: bool = True) -> int:
    """The global step recorded in the Lightning checkpoint ``path``, after checking it
    (``verify_checkpoint``) and reading it (tensors memory-mapped, not read); -1 for a
    DeepSpeed folder. ``CheckpointError`` naming the file when it is damaged."""
    path = Path(path)
    verified = verify_checkpoint(path, warn_missing=False)
    if path.is_dir():
        return -1
    try:
        ckpt = load_mmap(path)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{path}: not a readable Lightning checkpoint, truncated or "
                              f"damaged ({brief_error(err)})") from None
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    if not isinstance(step, int):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no global_step)")
    if not verified and warn_missing:
        warn_unverified(path)
    return step


def newest_checkpoint(folders: Iterable[str | os.PathLike],
                      files: Iterable[str | os.PathLike] = (), damaged: list[Path] | None = None,
                      quiet: bool = False) -> tuple[Path, int] | None:
    """The valid checkpoint of highest global step (then newest mtime) among the ``*.ckpt`` of
    ``folders`` and the existing ``files`` -> (path, step); None when there is none at all.
    Damaged ones are skipped with a warning line (none when ``quiet``) and added to
    ``damaged``; ``CheckpointError`` when all are damaged."""
    candidates = {Path(f) for f in files if Path(f).exists()}
    for folder in map(Path, folders):
        if folder.is_dir():
            candidates |= {p for p in folder.iterdir()
                           if p.suffix == ".ckpt" and not p.name.startswith(".")}
    if not candidates:
        return None
    valid, problems = [], []
    for path in sorted(candidates):
        try:
            step = checkpoint_step(path, warn_missing=not quiet)
        except CheckpointError as err:
            problems.append(str(err))
            if damaged is not None:
                damaged.append(path)
            if not quiet:
                warn(f"skipping {err}")
            continue
        valid.append((step, path.stat().st_mtime, path))
    if not valid:
        raise CheckpointError(
            f"none of the {len(candidates)} checkpoint(s) found is valid ({problems[0]}); pass "
            "--ckpt_path FILE, or move the damaged ones away to start afresh")
    step, _, path = max(valid)
    return path, step


def checkpoint_folders(trainer: Any) -> tuple[list[Path], list[Path]]:
    """The folders of the trainer's ``ModelCheckpoint`` callbacks and the files of its
    ``OnExceptionCheckpoint`` callbacks (the places Lightning's own ``last`` looks in)."""
    folders, files = [], []
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            dirpath = callback.dirpath
            if dirpath is None:  # Lightning's rule: under the logger's (next) version folder
                resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
                dirpath = resolve(trainer) if resolve is not None else None
            if dirpath is not None:
                folders.append(Path(dirpath))
        elif isinstance(callback, OnExceptionCheckpoint):
            files.append(Path(callback.ckpt_path))
    return folders, files


def resume_path(trainer: Any, ckpt_path: str | None,
                fits: Callable[[str], None] | None = None) -> str | None:
    """``--ckpt_path`` made concrete and checked before anything is built or written:
    ``last`` -> the newest valid checkpoint of the run (None, with a note, when the run has
    none yet); a file -> itself once verified and readable; ``fits(path)`` then checks it
    against the run (before the note saying what resumes). ``best``, ``hpc``, ``registry``
    and URLs are Lightning's to resolve."""
    if ckpt_path is None or not _local(ckpt_path) or ckpt_path in ("best", "hpc") \
            or str(ckpt_path).startswith("registry"):
        return ckpt_path
    if ckpt_path == "last":
        folders, files = checkpoint_folders(trainer)
        damaged: list[Path] = []
        try:
            found = newest_checkpoint(folders, files, damaged)
        except CheckpointError as err:
            raise CheckpointError(f"--ckpt_path last: {err}") from None
        if found is None:
            where = ", ".join(str(f) for f in folders + files) or "this run (no ModelCheckpoint)"
            note(f"--ckpt_path last: no checkpoint in {where}: starting from step 0")
            return None
        path, step = found
        if fits is not None:
            fits(str(path))
        set_aside(damaged)
        at = f"global step {step}" if step >= 0 else "a DeepSpeed folder: the newest"
        note(f"--ckpt_path last: resuming from {path} ({at})")
        return str(path)
    checkpoint_step(ckpt_path)
    if fits is not None:
        fits(str(ckpt_path))
    return str(ckpt_path)


def set_aside(damaged: Iterable[Path]) -> None:
    """Rename each damaged checkpoint file to ``NAME.damaged`` (its sidecar removed), with a
    warning line. Left in place, a damaged ``last.ckpt`` made the resumed run write
    ``last-v1.ckpt`` beside it, and ``kvgate export RUN/checkpoints/last.ckpt`` then read the
    damaged one; set aside, the run's own saves take its name."""
    if launch_rank() != 0:
        return  # rank 0 resolved the resume and set them aside before the others started
    for path in damaged:
        if path.is_dir():
            continue
        aside = path.with_name(f"{path.name}.damaged")
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            continue
        sidecar_path(path).unlink(missing_ok=True)
        warn(f"{path} is damaged: renamed {aside.name}, so that this run's {path.name} "
             "takes its place")


def better_checkpoint(path: str | os.PathLike) -> str:
    """For the error about the damaged or missing checkpoint ``path``: the valid checkpoint
    beside it to use instead (highest step, then newest), as ``"; ..."``; "" when none."""
    path = Path(path)
    if not path.parent.is_dir():
        return ""
    others = [p for p in path.parent.iterdir() if p.suffix == ".ckpt" and p != path
              and not p.name.startswith(".")]
    try:
        found = newest_checkpoint([], others, quiet=True)
    except CheckpointError:
        return ""
    if found is None:
        return ""
    good, step = found
    at = f"global step {step}" if step >= 0 else "a DeepSpeed folder"
    return f"; the newest valid checkpoint beside it is {good.name} ({at}): kvgate export {good} OUT"


class ChecksummedCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that keeps a sha256 sidecar with every checkpoint it writes and
    checks it on load (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if not _local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        sidecar_path(path).unlink(missing_ok=True)  # never a stale sidecar beside a new file
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        write_sidecar(path)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if _local(path):
            verify_checkpoint(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        if _local(path):
            sidecar_path(path).unlink(missing_ok=True)


class ChecksumCheckpoints(Callback):
    """Puts ``ChecksummedCheckpointIO`` in place of the strategy's plain ``TorchCheckpointIO``
    (a custom or asynchronous checkpoint IO is left as it is, without sidecars)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = ChecksummedCheckpointIO()
