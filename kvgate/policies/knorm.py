"""KNorm: keep the keys with the lowest L2 norm, per KV head.

Paper: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", Devoto et al.
2024, arXiv:2406.11430. Rule: a key with a low L2 norm tends to draw high attention, so the
key norm ranks the entries without computing any attention: score = -||k|| (the post-RoPE key
as the cache stores it), and each KV head keeps its ``B`` lowest-norm keys (kvpress's
``KnormPress``). No sinks and no window; one shot at the prefill, decoding does not evict.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import Budget, LayerPrompt, ScoredPolicy


@dataclass
class KNorm(ScoredPolicy):
    """The top-``B`` entries of every KV head by ``-||k||`` (fp32 norms; ties to the lower
    index)."""

    name = "knorm"
    needs_attention = False

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]``: minus the L2 norm of each key (garbage at padding, never kept)."""
        return -prompt.key.float().norm(dim=-1)
