"""Generation with a compressed cache (prefill, compact, decode) and its cost."""

from kvgate.inference.engine import ATTN_BACKENDS, Engine, GenerationResult, GenerationStats

__all__ = ["ATTN_BACKENDS", "Engine", "GenerationResult", "GenerationStats"]
