"""Errors raised while finding, converting or loading a base model."""

from __future__ import annotations

from kvgate.errors import KVGateError


class ModelLoadError(KVGateError, RuntimeError):
    """The model could not be found, converted or loaded; the message says why and what to do."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """The model family has no gated-attention support (LLaMA, Mistral, Qwen2 and Qwen3 have)."""


class DTypeError(ModelLoadError, ValueError):
    """A dtype name that is not one of the accepted spellings."""
