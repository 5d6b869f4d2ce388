"""Errors raised while finding, converting or loading a base model."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model could not be found, converted or loaded; the message says why and what to do."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """The model family has no gated-attention support (only LLaMA and Mistral have)."""


class DTypeError(ModelLoadError, ValueError):
    """A dtype name that is not one of the accepted spellings."""
