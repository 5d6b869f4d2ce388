"""Where processed data is cached, and atomic writes so a killed run leaves no half file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$KVGATE_CACHE`` or ``~/.cache/kvgate`` (the same root the model loader uses)."""
    return Path(os.environ.get("KVGATE_CACHE") or "~/.cache/kvgate").expanduser()


def data_cache_dir() -> Path:
    return cache_root() / "data"


def read_json(path: Path) -> Any | None:
    """The cached value, or None when the file is missing or unreadable (then it is rebuilt)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` fills a temporary file in the same folder, which is flushed to disk and
    renamed over ``path``.

    The rename is atomic on POSIX, so concurrent readers see either the old file or the whole new
    one, never a prefix; a failure or a kill leaves no ``path`` half written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, written atomically (:func:`write_atomic`)."""
    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False)

    write_atomic(path, dump)
