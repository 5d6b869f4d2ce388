"""A stream that says it is a terminal, for the tests of progress displays (``kvgate.progress``
draws a bar on one and plain lines on any other stream)."""

from __future__ import annotations

import io


class Terminal(io.StringIO):
    """An in-memory stream whose ``isatty()`` is true."""

    def isatty(self) -> bool:
        return True
