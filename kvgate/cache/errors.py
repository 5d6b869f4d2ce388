"""The one error type the cache raises for misuse (wrong model setup, unsupported operation)."""

from __future__ import annotations


class CacheError(RuntimeError):
    """CompressedCache used in a way it cannot support; the message says what to do instead."""
