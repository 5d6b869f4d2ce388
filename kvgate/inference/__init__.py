"""Generation with a compressed cache (prefill, compact, decode) and its cost.

Names load on first use, so that the command line (``kvgate.cli``) imports no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTN_BACKENDS", "CompressedContext", "Engine", "GenerationResult",
           "GenerationStats"]


def __getattr__(name: str) -> Any:
    if name == "CompressedContext":
        from kvgate.inference.compress import CompressedContext

        return CompressedContext
    if name in __all__:
        from kvgate.inference import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvgate.inference' has no attribute {name!r}")
