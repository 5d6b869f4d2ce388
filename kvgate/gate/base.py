"""What every gate kind shares: hard keep flags with the sigmoid's gradient, the switch that
opens it, and the route into the gated attention (kvgate.models.dispatch)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvgate.gate.apply import gated_layer_attention
from kvgate.gate.config import GateConfig
from kvgate.models.dispatch import ForwardContext, GatedRoute, Router


def straight_through(scores: Tensor, gamma: float, tau: float) -> Tensor:
    """Hard keep flags in the forward pass, the sigmoid's gradient in the backward pass."""
    soft = torch.sigmoid(scores + gamma)
    hard = (soft > tau).to(soft.dtype)
    return hard + soft - soft.detach()


def in_gate_dtype(hidden: Tensor, weight: Tensor) -> Tensor:
    """A gate's input in its weights' dtype (fp32: the gates train in fp32 beside a bf16
    base). Under autocast it is left as it comes: autocast runs the gate's matmuls in its own
    dtype whatever the input's, so the upcast would only add a copy per layer (on a GPU, a
    third of what gates + LoRA spend over LoRA alone outside the attention kernel)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return hidden
    return hidden.to(weight.dtype)


class Gate(GatedRoute):
    """A gate hung on one attention module as ``kv_gate``: raw scores ``[B, H_gate, n]`` from
    the layer's normalised input (``scores``), thresholded as the Attention-Gate paper's
    ``sigmoid(score + gamma) > tau`` with a straight-through gradient (``forward``).

    ``local``: the kind scores a token from its own hidden state alone, so a token can be
    scored when it is written, also while decoding (KVzap, arXiv:2601.07891); the attention
    kind reads the tokens before it and scores the prompt only.

    Every kind takes ``(hidden_size, out_heads, config, head_dim)`` so that ``patch`` builds
    any of them alike (``kvgate.gate.kinds``).
    """

    kind: str = ""
    local: bool = False

    def __init__(self, config: GateConfig, out_heads: int) -> None:
        super().__init__()
        self.config = config
        self.out_heads = out_heads
        # Off while the gate should not act (gates-open teacher, LoRA-only training, decode).
        self.active = True

    def scores(self, hidden: Tensor, position_embeddings=None,
               attend: Tensor | None = None) -> Tensor:
        """Raw gate scores ``[B, H_gate, n]`` (before gamma and the sigmoid), in fp32.
        hidden [B, n, D]; position_embeddings the rotary (cos, sin) and attend [B, 1, n, n]
        bool (None = causal) serve the attention kind; a local kind ignores them."""
        raise NotImplementedError

    def forward(self, hidden: Tensor, position_embeddings=None, attend: Tensor | None = None,
                tau: float | None = None) -> Tensor:
        """Straight-through flags ``[B, H_gate, n]``. ``tau`` overrides the config's keep
        threshold (inference only: a trained gate's eviction dialled without retraining)."""
        s = self.scores(hidden, position_embeddings, attend)
        return straight_through(s, self.config.gamma, self.config.tau if tau is None else tau)

    def routes(self, router: Router) -> bool:
        # a stored prompt (one-shot training's two passes) is read also with the gates open
        return self.active or router.prefix is not None

    def gated_attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None,
                     context: ForwardContext, **kwargs) -> tuple[Tensor, None]:
        return gated_layer_attention(module, query, key, value, attention_mask, scaling, context)
