"""One run per run folder: ``RUN_DIR/.kvgate-run.lock``.

The lock file is created with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3+) and holds the
owner's pid, host and start time as JSON. A second run into the same folder is refused with a
line that names the owner. A lock whose owner is gone (killed with ``kill -9``, a crashed
machine: nothing ran its clean-up) is taken over with a warning line when the owner is known to
be dead: same host and the pid no longer runs, or runs a process started after the lock was
taken (the pid was reused). A lock from another host cannot be checked and is refused; the
message says to delete the file when that run is gone. The lock is released (the file removed)
on exit, also on an exception; a lock that another run took over meanwhile is left alone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvgate.training.errors import RunInUseError, warn

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".kvgate-run.lock"
GARBLED_GRACE_S = 60.0  # a lock file still empty this long after its creation is a dead one
_HELD: set[str] = set()  # lock files this process holds (its own pid is not a stale owner)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_start(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch; Linux /proc), or None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class RunLock:
    """``with RunLock(folder): ...`` or ``lock = RunLock(folder).acquire(); lock.release()``."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ public
    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # another run may take over the same stale lock at the same time
            if self._create():
                return self
            owner = self._read_owner()
            if owner is not None and str(self.path.resolve()) not in _HELD:
                reason = self._stale_reason(owner)
                if reason is not None:
                    self._take_over(owner, reason)
                    continue
            raise RunInUseError(self._in_use_message(owner))
        raise RunInUseError(f"{self.path}: could not take the run lock (other runs keep taking it)")

    def release(self) -> None:
        key = str(self.path.resolve())
        if key not in _HELD:
            return
        _HELD.discard(key)
        try:
            if json.loads(self.path.read_text()) == self.info:  # still ours
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> RunLock:  # noqa: PYI034 - final in practice; Self needs 3.11
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ----------------------------------------------------------------- helpers
    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self.info = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.info, f)
            f.flush()
            os.fsync(f.fileno())
        _HELD.add(str(self.path.resolve()))
        return True

    def _read_owner(self) -> dict[str, Any] | None:
        """The lock's JSON, ``{}`` when it is garbled (a run killed while writing it), None
        when the file went away meanwhile."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            info = json.loads(text)
        except ValueError:
            return {}
        ok = isinstance(info, dict) and isinstance(info.get("pid"), int) and "host" in info
        return info if ok else {}

    def _stale_reason(self, owner: dict[str, Any]) -> str | None:
        """Why ``owner`` is known to be gone, or None when it may still run."""
        if not owner:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return "gone"
            return f"unreadable and {age:.0f} s old" if age > GARBLED_GRACE_S else None
        if owner["host"] != socket.gethostname():
            return None
        pid = owner["pid"]
        if pid == os.getpid():
            return f"pid {pid} is this process, which did not take it: a run before a restart"
        if not _pid_alive(pid):
            return f"pid {pid} is no longer running"
        try:
            taken = datetime.fromisoformat(owner.get("started", "")).timestamp()
        except (TypeError, ValueError):
            return None
        started = _process_start(pid)
        if started is not None and started > taken + 1.0:
            return f"pid {pid} now belongs to a process started after the lock was taken"
        return None

    def _take_over(self, owner: dict[str, Any], reason: str) -> None:
        """Move the stale lock aside (only one of several runs doing this wins the rename)."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run moved it first; try to create ours again
        aside.unlink(missing_ok=True)
        who = (f"pid {owner['pid']} on {owner['host']} (started {owner.get('started')})"
               if owner else "an unknown run")
        warn(f"{self.path}: left by {who}; {reason}: taking it over")

    def _in_use_message(self, owner: dict[str, Any] | None) -> str:
        if owner is None:
            return f"{self.folder}: its run lock {self.path} keeps changing; try again"
        if not owner:
            return (f"{self.folder} is in use: its run lock {self.path} is unreadable and new "
                    f"(a run is starting); if no run is using the folder, delete that file")
        where = f"pid {owner['pid']} on {owner['host']}"
        if str(self.path.resolve()) in _HELD:
            where += " (this process)"
        return (f"{self.folder} is in use by {where} since {owner.get('started')} "
                f"(lock file {self.path}); wait for that run to end or choose another run "
                f"folder (--run_dir); if that run is gone, delete the lock file")
