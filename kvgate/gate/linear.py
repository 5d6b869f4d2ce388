"""The ``linear`` gate kind: each token's keep score from its own normalised hidden state,
through one linear map per layer.

KVzap (arXiv:2601.07891) trains, per layer, a linear scorer from the hidden state entering
attention to a score per KV head, and evicts the entries scored below a threshold outside a
recent window, at the prefill and while decoding; the Attention-Gate paper (Zeng et al. 2024,
arXiv:2410.12876) ablates the same idea as its "local" gate. Here it trains like the
Attention-Gate (hard flags ``sigmoid(score + gamma) > tau``, straight-through gradient,
eviction loss). It has no settings of its own.

It starts wide open: the map is zero, so every score is 0 and every keep probability is
``sigmoid(gamma)`` (above ``tau`` at the defaults), and the patched model starts as the base
model. The zero map still learns from the first step (its gradient is the hidden state times
the flags' gradient).
"""

from __future__ import annotations

from torch import Tensor, nn

from kvgate.gate.base import Gate, in_gate_dtype
from kvgate.gate.settings import GateSettings

__all__ = ["LinearGate"]


class LinearGate(Gate):
    """``D -> H_gate``: one linear map per layer (KVzap's linear scorer; the paper's local
    gate). ``scores(hidden [B, n, D]) -> [B, H_gate, n]`` fp32."""

    kind = "linear"
    local = True

    def __init__(self, hidden_size: int, out_heads: int, config: GateSettings,
                 head_dim: int | None = None) -> None:
        super().__init__(config, out_heads)
        self.proj = nn.Linear(hidden_size, out_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)  # wide open: see the module docstring
        nn.init.zeros_(self.proj.bias)

    def scores(self, hidden: Tensor, position_embeddings=None,
               attend: Tensor | None = None) -> Tensor:
        return self.proj(in_gate_dtype(hidden, self.proj.weight)).float().transpose(1, 2)

    def extra_repr(self) -> str:
        return f"out_heads={self.out_heads}, tau={self.config.tau}, gamma={self.config.gamma}"
