"""Where an export goes: what ``--overwrite`` may replace, the temporary sibling it is written
in, the rename into place, and the clean-up of what a killed export left.

``--overwrite`` replaces only what an export wrote before (a folder holding a gated export) or
an empty folder. Anything else (a file, a run folder, the folder holding the checkpoint being
exported, a folder of other files) is refused in one line naming why: a typo such as
``kvgate export RUN/checkpoints/last.ckpt RUN --overwrite`` must not delete a run.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvgate.checkpoint.format import CheckpointError, is_gated_export

# what marks a training run's folder (kvgate.training writes them; named here, not imported)
_RUN_MARKS = (".kvgate-run.lock", "checkpoints", "tb", "lightning_logs")
_OWNED = re.compile(r"(?P<pid>\d+)@(?P<host>.+)-[^-]*$")  # PID@HOST-XXXX (mkdtemp's tail)
STALE_UNOWNED_S = 86400.0  # a temporary without owner untouched this long is a dead one


def check_target(out: Path, overwrite: bool, inputs: Iterable[str | os.PathLike] = (),
                 owned: Callable[[Path], bool] = is_gated_export) -> None:
    """``CheckpointError`` unless an export may be written to ``out``: a new path, or with
    ``overwrite`` an existing export (``owned``: a gated export, or a KVzap folder for that
    format) or empty folder that holds none of ``inputs`` (the files the export reads)."""
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise CheckpointError(f"{out}: already exists (pass overwrite=True / --overwrite to "
                              "replace a gated export)")
    refuse = "--overwrite replaces only a gated export or an empty folder"
    if out.is_symlink() or not out.is_dir():
        raise CheckpointError(f"{out}: is a file, not a gated export; {refuse}")
    target = out.resolve()
    for path in inputs:
        source = Path(path).resolve()
        if source == target or target in source.parents:
            raise CheckpointError(f"{out}: holds the checkpoint being exported ({path}); "
                                  f"{refuse}: export to another folder (e.g. {out / 'gated'})")
    if owned(out) or not any(out.iterdir()):
        return
    marks = [name for name in _RUN_MARKS if (out / name).exists()]
    if marks or any(out.rglob("*.ckpt")):
        why = f"a training run's folder (it holds {', '.join(marks) or 'checkpoints'})"
        raise CheckpointError(f"{out}: is {why}; {refuse}: export to {out / 'gated'} instead")
    raise CheckpointError(f"{out}: holds files that are not a gated export; {refuse}")


def os_reason(err: OSError) -> str:
    name = getattr(err, "filename", None)
    if isinstance(err, FileExistsError) and name and not Path(name).is_dir():
        return f"{name} is a file, not a folder"
    where = f": {name}" if name else ""
    return f"{err.strerror or str(err).splitlines()[0]}{where}"


def owner() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def temporary_folder(out: Path) -> Path:
    """A new empty ``.NAME.tmp-PID@HOST-XXXXXXXX`` beside ``out``, made by a plain ``mkdir``
    so that its mode is what the umask gives a new folder (``tempfile.mkdtemp`` makes 0700,
    which the export used to keep)."""
    for _ in range(100):
        path = out.parent / f"{temp_prefix(out)}{owner()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(out.parent))


def share_as_umask(root: Path) -> None:
    """Give every file and folder under ``root`` the mode a plain create would have under
    this process's umask: writers such as safetensors make their files 0600 whatever it is.
    ``root`` came from ``temporary_folder``, so its own mode is that of a new folder, and a
    new file's is the same without the execute bits."""
    folder = stat.S_IMODE(root.stat().st_mode)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, folder if path.is_dir() else folder & 0o666)


def write_through_temporary(out: Path, fill: Callable[[Path], None]) -> Path:
    """Write an export at ``out`` the one safe way: ``fill(tmp)`` writes its files into a new
    temporary sibling, which then gets the umask's modes (``share_as_umask``) and is renamed
    into place (``replace``). An OS error is a ``CheckpointError`` naming ``out``; any failure
    or interrupt leaves no temporary behind (a kill leaves one the next export removes)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp = temporary_folder(out)  # the umask's mode, not mkdtemp's 0700
    except OSError as err:
        raise CheckpointError(f"{out}: cannot write the export ({os_reason(err)})") from None
    try:
        fill(tmp)
        share_as_umask(tmp)  # safetensors writes 0600 files
        replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{out}: cannot write the export ({os_reason(err)})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _newest_mtime(path: Path) -> float:
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        for inner in path.rglob("*"):
            try:
                times.append(inner.lstat().st_mtime)
            except OSError:
                pass
    return max(times)


def _is_stale(path: Path, tail: str, now: float) -> bool:
    match = _OWNED.match(tail)
    if match is None:  # an older kvgate's temporary: judged by its last write
        return now - _newest_mtime(path) > STALE_UNOWNED_S
    pid, host = int(match["pid"]), match["host"]
    if host != socket.gethostname():
        return False  # another machine's export (a shared disk): cannot tell, keep it
    return pid != os.getpid() and not _pid_alive(pid)


def remove_path(path: Path) -> None:
    """Remove ``path`` whatever it is: a folder with its contents, a file, a link (not its
    target); gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(out: str | os.PathLike) -> list[Path]:
    """Remove what an export into ``out`` killed before it finished left beside it
    (``.NAME.tmp-*``, and ``.NAME.old-*``, the old ``out`` moved aside: a folder, a file or a
    link); a live export's are kept. Returns the paths removed."""
    out = Path(out)
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    now = time.time()
    for kind in (".tmp-", ".old-"):
        prefix = f".{out.name}{kind}"
        for path in out.parent.iterdir():
            if path.name.startswith(prefix) and _is_stale(path, path.name[len(prefix):], now):
                remove_path(path)
                removed.append(path)
    return removed


def replace(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``; an old ``out`` survives until then."""
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{owner()}-", dir=out.parent))
        old.rmdir()
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        remove_path(old)
