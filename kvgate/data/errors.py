"""Errors raised while loading tasks, splits and corpora."""

from __future__ import annotations

from kvgate.errors import KVGateError


class DataError(KVGateError, ValueError):
    """A bad task name, split, file or field; the message names it and what is accepted."""


class HubUnavailableError(DataError):
    """The Hugging Face Hub cannot be reached (offline switch set, or no network)."""
