"""The one reader of the files a user names, and the one check of the paths a command writes to.

Every command reads a user's text (``infer --prompt-file`` / ``--context-file``, ``eval ppl
--text-files``) through ``read_user_text`` and checks each output folder (``eval --out``, also
of ``eval calibrate`` and ``eval report``, ``train --run_dir``, ``export OUT``, ``data oracle``'s
``data.init_args.oracle.path``) with ``check_output_dir`` before any model is read, so a
missing file, a folder where a file was meant, text that is not UTF-8 or an output path that
runs through a file or into a folder that cannot be written is one ``UserFileError`` line
naming the flag and the path, not a traceback from deep inside (or, for ``eval calibrate``,
after the whole computation).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from kvgate.errors import KVGateError

__all__ = ["UserFileError", "check_output_dir", "read_user_text"]


class UserFileError(KVGateError, ValueError):
    """A file the user named cannot be read as text, or an output path cannot be a folder."""


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (what checkpoints and label shards record
    to tell a whole file from a damaged or replaced one)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _label(what: str, path: Path) -> str:
    return f"{what} {path}" if what else str(path)


def read_user_text(path: str | os.PathLike, what: str = "") -> str:
    """The whole of ``path`` decoded as UTF-8 (a leading byte-order mark dropped).

    ``what`` names where the path came from (``"--context-file"``) for the message. A missing
    file, a folder, an unreadable file or bytes that are not UTF-8 raise ``UserFileError``; the
    last names the byte offset of the first bad byte, so the user can find it.
    """
    path = Path(path).expanduser()
    label = _label(what, path)
    if path.is_dir():
        raise UserFileError(f"{label}: is a folder, not a text file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserFileError(f"{label}: no such file") from None
    except OSError as err:
        raise UserFileError(f"{label}: cannot be read ({err.strerror or err})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        # utf-8-sig counts offsets after a BOM it dropped; report them in the file's bytes
        start = err.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        raise UserFileError(
            f"{label}: not UTF-8 text (byte 0x{data[start]:02x} at offset {start:,}); save it "
            "as UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8") from None


def check_output_dir(path: str | os.PathLike, what: str = "") -> Path:
    """``path`` as a folder a command may create or write into; ``UserFileError`` when it is a
    file, when a folder on the way to it is a file (nothing can be made inside a file), or
    when the folder (or, before it exists, the nearest folder above it, where it would be
    made) cannot be written. Leaves nothing behind: a refused command leaves the disk as it
    was, and an accepted one finds it as it was."""
    path = Path(path).expanduser()
    label = _label(what, path)
    if path.exists() and not path.is_dir():
        raise UserFileError(f"{label}: is a file, not a folder; give a folder path")
    # where the folder is, or where it would be made: the nearest folder above it that exists
    existing = path if path.is_dir() else next((p for p in path.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserFileError(f"{label}: {existing} is a file, so no folder can be made inside "
                            "it; give another path")
    if existing is not None:
        _check_writable(existing, label, "it" if existing == path else str(existing))
    return path


def _check_writable(folder: Path, label: str, where: str) -> None:
    """Create and remove a probe file in ``folder``: only trying tells (``os.access`` reads
    permission bits, which root passes, and misses what the file system alone decides: an
    immutable folder on some, a root-squashed NFS share, ...)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvgate-write-probe-", dir=folder)
    except OSError as err:
        raise UserFileError(f"{label}: nothing can be written in {where} "
                            f"({err.strerror or err}); give a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)
