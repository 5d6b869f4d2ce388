"""The one error type the cache raises for misuse (wrong model setup, unsupported operation)."""

from __future__ import annotations

from kvgate.errors import KVGateError


class CacheError(KVGateError, RuntimeError):
    """CompressedCache used in a way it cannot support; the message says what to do instead."""
