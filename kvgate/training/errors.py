"""Errors of the training side; each message names the offending key or file."""

from __future__ import annotations


class TrainingConfigError(ValueError):
    """A training setting is invalid or unusable on this machine; the message names the key."""
