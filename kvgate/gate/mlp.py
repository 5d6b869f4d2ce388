"""The ``mlp`` gate kind: each token's keep score from its own normalised hidden state, through
a two-layer MLP.

KVzap (arXiv:2601.07891) trains, per layer, a two-layer MLP (``D -> 512 -> H_kv``, GELU) from
the hidden state entering attention to a score per KV head, and at inference evicts the entries
scored below a threshold outside a recent window, at the prefill and while decoding. Here it
trains like the Attention-Gate (Zeng et al. 2024, arXiv:2410.12876: hard flags
``sigmoid(score + gamma) > tau``, straight-through gradient, eviction loss): only the module
that scores differs.

It starts wide open: the output layer is zero, so every score is 0 and every keep probability
is ``sigmoid(gamma)`` (above ``tau`` at the defaults), and the patched model starts as the base
model, as ``gamma`` makes the Attention-Gate start near full retention. The zero output layer
still learns from the first step (its gradient is the hidden activation times the flags'
gradient); the inner layer follows from the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from kvgate.gate.base import Gate, in_gate_dtype
from kvgate.gate.settings import GateSettings, KindSettings

__all__ = ["MLPGate", "MLPSettings"]


@dataclass
class MLPSettings(KindSettings):
    """The MLP's inner width."""

    hidden: int = 512  # the mlp kind's inner width (KVzap: 512)

    shapes = ("hidden",)

    def validate(self) -> None:
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise self._bad("hidden", "must be a positive integer")


class MLPGate(Gate):
    """``D -> hidden -> H_gate`` with GELU: KVzap's MLP scorer (hidden 512 in the paper).
    ``scores(hidden [B, n, D]) -> [B, H_gate, n]`` fp32."""

    kind = "mlp"
    local = True
    settings_class = MLPSettings

    def __init__(self, hidden_size: int, out_heads: int, config: GateSettings,
                 head_dim: int | None = None) -> None:
        super().__init__(config, out_heads)
        self.up = nn.Linear(hidden_size, self.settings.hidden)
        self.down = nn.Linear(self.settings.hidden, out_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.weight)  # wide open: see the module docstring
        nn.init.zeros_(self.down.bias)

    def scores(self, hidden: Tensor, position_embeddings=None,
               attend: Tensor | None = None) -> Tensor:
        x = in_gate_dtype(hidden, self.up.weight)
        return self.down(nn.functional.gelu(self.up(x))).float().transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"hidden={self.settings.hidden}, out_heads={self.out_heads}, "
                f"tau={self.config.tau}, gamma={self.config.gamma}")
