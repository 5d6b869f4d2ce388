"""StreamingLLM: attention sinks plus a recent window.

Paper: "Efficient Streaming Language Models with Attention Sinks", Xiao et al. 2023,
arXiv:2309.17453. Rule: the first tokens of the sequence (the attention sinks that absorb
attention mass) stay forever, the rest of the budget is the most recent tokens; decoding
evicts the oldest non-sink entry.

Two variants, because the codebases disagree:
- ``paper``: ``S`` sink tokens (default 4) + the last ``B - S`` tokens (StreamingLLM; the
  AhaKV / RoCo baselines).
- ``factory``: the first ``B - w`` tokens + the last ``w`` (KVCache-Factory's
  ``StreamingLLMKVCluster``, so numbers from Ada-KV's table reflect this one).
Original positions are kept (keys are cached after RoPE; no rolling re-rotation).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import (
    Budget,
    DecodeEvicting,
    LayerPrompt,
    by_position,
    check_choice,
    check_decode,
    check_int,
    check_prompt,
    first_real,
    last_real,
)


@dataclass
class Streaming(DecodeEvicting):
    """Sinks + recent. ``sinks`` is used by the paper variant, ``window`` by the factory one."""

    variant: str = "paper"
    sinks: int = 4
    window: int = 32

    name = "streaming"

    def __post_init__(self) -> None:
        check_choice(self.name, "variant", self.variant, ("paper", "factory"))
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 1)

    def split(self, kept: Tensor) -> tuple[Tensor, Tensor]:
        """(sink count, recent count) for ``kept`` entries per head, any shape, long."""
        if self.variant == "paper":
            head = kept.clamp(max=self.sinks)
            return head, kept - head
        recent = kept.clamp(max=self.window)
        return kept - recent, recent

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """``[B, H_kv, n]`` bool: the first sinks and the last recent real tokens."""
        check_prompt(prompt)
        b, hk, n = prompt.key.shape[:3]
        head, recent = self.split(budget.per_sample(prompt.n_real))
        keep = first_real(prompt.valid, head) | last_real(prompt.valid, recent)
        return keep.expand(b, hk, n).clone()

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        return {}

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Evict the oldest non-sink slots: keep the oldest ``head`` plus the newest rest."""
        check_decode(logits, valid, positions, capacity)
        head, _ = self.split(capacity)
        sinks = by_position(positions, valid, head, newest=False)
        recent = by_position(positions, valid & ~sinks, capacity - head, newest=True)
        return stats, sinks | recent
