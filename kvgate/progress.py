"""The one progress display of every job that runs over a minute: label computation, training,
calibration, every ``kvgate eval`` benchmark and the GGUF conversion.

``Progress(total, what, unit)`` counts the steps a job has done of ``total`` and shows them on
``stream`` (``sys.stderr`` unless given: stdout keeps each command's results):

- on a terminal (the stream's ``isatty()``): one tqdm bar, done / total, elapsed and time left,
  ``labels: 40%|####      | 16/40 [02:10<03:15, 8.13s/block]``;
- anywhere else (a log file, a pipe, a batch job's output): a plain line per step,
  ``labels: 16/40 blocks (40%), 2m10s elapsed, ~3m15s left``, at most one every
  ``LINE_EVERY_S`` seconds: a step done sooner after the last line prints none, except the
  last step, which always prints. Jobs of slow steps (label shards, calibration runs, training
  steps of a real model) so print every step, and jobs of fast ones (eval examples on a small
  model) a line every few seconds, not thousands;
- quiet: nothing. A job's own ``quiet`` argument, or :func:`silenced` around it, which is
  what the command line's ``--quiet`` sets (it also silences a job started inside another,
  such as the GGUF conversion inside a first model load).

Time left is the mean time of the steps done in this run times the steps left; a job that
finds part of its plan done before (a resumed run) or cut short (a search that converged)
takes it out of ``total`` with :meth:`Progress.drop`, so the estimate follows.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Self, TextIO

LINE_EVERY_S = 5.0

_QUIET = contextvars.ContextVar("kvgate_progress_quiet", default=False)


@contextlib.contextmanager
def silenced(quiet: bool = True) -> Iterator[None]:
    """Every ``Progress`` made inside it is quiet (when ``quiet``; else nothing changes)."""
    token = _QUIET.set(bool(quiet) or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h10m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class Progress:
    """One job's progress: ``advance`` after each step, ``close`` (or a ``with`` block) at
    the end. ``done``: steps done before this run (a resumed one), shown but not timed;
    ``unit``: one step's name (the lines add an ``s``); ``every``: seconds between two lines
    (``LINE_EVERY_S``)."""

    def __init__(self, total: int, what: str, unit: str = "step", *, done: int = 0,
                 quiet: bool = False, stream: TextIO | None = None,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.total, self.what, self.unit = max(int(total), int(done)), what, unit
        self.done = self.start = int(done)
        self.quiet = bool(quiet) or _QUIET.get()
        self.stream = sys.stderr if stream is None else stream
        self.every = LINE_EVERY_S if every is None else every
        self.clock = clock
        self.t0 = clock()
        self.note = ""
        self._shown_at: float | None = None
        self._shown = (self.done, self.total)  # what the last line said
        self._bar: Any = None
        self._closed = False
        if not self.quiet and is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=self.done, desc=what, unit=unit,
                             file=self.stream, leave=True)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """``n`` more steps done; ``note``: what the job is at (shown beside the count)."""
        self.done += int(n)
        self.total = max(self.total, self.done)
        if note is not None:
            self.note = note
        if self._bar is not None:
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.total = self.total
            self._bar.update(int(n))
        elif not self.quiet:
            self._line(force=False)

    def drop(self, n: int) -> None:
        """``n`` steps of the plan need not run (done before, or no longer asked for)."""
        self.total = max(self.done, self.total - int(n))
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def line(self) -> str:
        """The plain line of the state now: done / total, elapsed, time left."""
        elapsed = self.clock() - self.t0
        moved = self.done - self.start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"{self.what}: {self.done}/{self.total} {self.unit}s ({pct:.0f}%), "
                f"{duration(elapsed)} elapsed")
        if self.done >= self.total:
            text += ", done"
        elif moved > 0:
            text += f", ~{duration(elapsed / moved * (self.total - self.done))} left"
        return text + (f"; {self.note}" if self.note else "")

    def _line(self, force: bool) -> None:
        now = self.clock()
        due = (self._shown_at is None or now - self._shown_at >= self.every
               or self.done >= self.total)
        if (due or force) and self.done > self.start and (self.done, self.total) != self._shown:
            print(self.line(), file=self.stream, flush=True)
            self._shown_at, self._shown = now, (self.done, self.total)

    def close(self) -> None:
        """The bar's last state stays on the terminal; without a bar, the last state's line
        is printed when the throttle held it back (or a drop changed it since)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.close()
        elif not self.quiet:
            self._line(force=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
