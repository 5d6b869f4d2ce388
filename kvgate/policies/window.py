"""Local window: keep the most recent ``B`` entries of every KV head. No paper of its own: the
"Local" baseline of the eviction papers (H2O, StreamingLLM, Attention-Gate compare against it).

Prefill: the last ``B`` real prompt tokens. Decode: a sliding window that evicts the oldest
entry once a head is over its capacity. Without sinks, quality collapses once the first token leaves the cache (the attention-sink
effect); that collapse is the expected behaviour of this baseline, not a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import (
    Budget,
    DecodeEvicting,
    LayerPrompt,
    by_position,
    check_decode,
    check_prompt,
    last_real,
)


@dataclass
class Window(DecodeEvicting):
    """Prefill: the last ``B`` real tokens of every head. Decode: a sliding window."""

    name = "window"

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool."""
        check_prompt(prompt)
        b, hk, n = prompt.key.shape[:3]
        kept = budget.per_sample(prompt.n_real)
        return last_real(prompt.valid, kept).expand(b, hk, n).clone()

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        return {}  # position is the only criterion: nothing to accumulate

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Keep the ``capacity`` newest slots ([B, H_kv, T] bool)."""
        check_decode(logits, valid, positions, capacity)
        return stats, by_position(positions, valid, capacity, newest=True)
