"""``kvgate eval ppl``'s options: perplexity of texts' continuations under eviction; the
cache's storage (``--kv-bits``) for ``--mode cache``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.eval.config import CorpusConfig, _at_least
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.eval.qa_options import (
    kv_bits_opt,
    kv_cache_only,
    kv_group_opt,
    kv_residual_opt,
    kv_settings,
)


@dataclass
class PPLConfig(CorpusConfig):
    """Perplexity of the second half of texts given their compressed first half."""

    max_length: int = opt(512, "tokens of each text")
    prefix: float = opt(0.5, "share of each text compressed")
    context: int | None = opt(None, "fixed context length: join the texts into one stream and "
                              "cut windows of context + continuation tokens (overrides "
                              "--max-length/--prefix)")
    continuation: int | None = opt(None, "scored tokens per window (default: = --context)")
    windows: int | None = opt(None, "windows to score (default: all)")
    truncate: bool = opt(False, "cut a text longer than the model's context to it (a warning "
                         "says how much was dropped) instead of refusing it")
    step: int | None = opt(None, "with --mode cache: feed the continuation this many tokens per "
                           "forward, the cache evicting after each (1 = decoding: H2O, TOVA, "
                           "StreamingLLM and local gates hold their capacity); default: one "
                           "forward")
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.step, "--step")
        if self.step is not None and self.mode != "cache":
            raise EvalError("--step feeds the continuation through a real cache: add --mode cache")
        _at_least(self.max_length, "--max-length")
        if not 0.0 < self.prefix < 1.0:
            raise EvalError(f"--prefix must lie in (0, 1), got {self.prefix}")
        _at_least(self.context, "--context")
        _at_least(self.continuation, "--continuation")
        _at_least(self.windows, "--windows")
        kv_cache_only(self, self.mode == "cache")

    def settings(self) -> dict[str, Any]:
        step = {} if self.step is None else {"step": self.step}
        base = {**super().settings(), **kv_settings(self)}
        if self.context is not None:  # window sizes are in the key; --windows only selects
            return {**base, **step}
        return {**base, "max_length": self.max_length, "prefix": self.prefix,
                "truncate": bool(self.truncate), **step}
