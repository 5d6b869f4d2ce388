"""The one reader of the files a user names, and the one check of the paths a command writes to.

Every command reads a user's text (``infer --prompt-file`` / ``--context-file``, ``eval ppl
--text-files``) through ``read_user_text`` and checks each output folder (``eval --out``,
``train --run_dir``, ``export OUT``) with ``check_output_dir`` before any model is read, so a
missing file, a folder where a file was meant, text that is not UTF-8 or an output path that
runs through a file is one ``UserFileError`` line naming the flag and the path, not a
traceback from deep inside.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.errors import KVGateError

__all__ = ["UserFileError", "check_output_dir", "read_user_text"]


class UserFileError(KVGateError, ValueError):
    """A file the user named cannot be read as text, or an output path cannot be a folder."""


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
    file, or when a folder on the way to it is a file (nothing can be made inside a file).
    Creates nothing: a refused command leaves the disk as it was."""
    path = Path(path).expanduser()
    label = _label(what, path)
    if path.exists() and not path.is_dir():
        raise UserFileError(f"{label}: is a file, not a folder; give a folder path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserFileError(f"{label}: {parent} is a file, so no folder can be made "
                                    "inside it; give another path")
            break
    return path
