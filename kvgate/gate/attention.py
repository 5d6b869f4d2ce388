"""The Attention-Gate: a small attention layer that decides, per token and per gated head,
whether that token's K/V stay in the cache ("In-context KV-Cache Eviction for LLMs via
Attention-Gate", Zeng et al. 2024, arXiv:2410.12876). The gate kind ``attention``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from kvgate.gate.base import Gate, in_gate_dtype
from kvgate.gate.settings import GateSettings, KindSettings

__all__ = ["AttentionGate", "AttentionSettings", "GateMode"]

GateMode = Literal["causal", "prompt_bidirectional"]


@dataclass
class AttentionSettings(KindSettings):
    """The Attention-Gate's own attention (paper: h' = 4 heads of d'_k)."""

    heads: int = 4  # h': heads of the gate's own small attention
    head_dim: int | None = None  # d'_k; None -> the model's head_dim
    rope: bool = True  # apply the model's rotary positions to the gate's q'/k'
    mode: GateMode = "causal"  # gate attention: causal, or bidirectional over the prompt only

    shapes = ("heads", "head_dim")

    def validate(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise self._bad("heads", "must be a positive integer")
        if self.head_dim is not None and (isinstance(self.head_dim, bool)
                                          or not isinstance(self.head_dim, int)
                                          or self.head_dim < 1):
            raise self._bad("head_dim", "must be a positive integer or null")
        if not isinstance(self.rope, bool):
            raise self._bad("rope", "must be true or false")
        if self.mode not in get_args(GateMode):
            raise self._bad("mode", "must be 'causal' or 'prompt_bidirectional'")


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _gate_rotary(cos: Tensor, sin: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Cut the model's rotary tables (cat(f, f) over head_dim/2 frequencies) down to ``dim``
    dimensions by keeping the first dim/2 frequencies, so the gate uses the model's positions."""
    half_model, half = cos.shape[-1] // 2, dim // 2
    if half > half_model:
        raise ValueError(f"gate head_dim {dim} exceeds the model's rotary dim {cos.shape[-1]}")
    idx = torch.cat([torch.arange(half), torch.arange(half_model, half_model + half)]).to(cos.device)
    return cos.index_select(-1, idx), sin.index_select(-1, idx)


class AttentionGate(Gate):
    """MHA' of the paper: ``h'`` heads of size ``d'`` over the layer input, projected to one
    score per gated head (the model's KV heads by default).

    forward(hidden [B, n, D], position_embeddings (cos, sin) [B, n, d_model] | None,
            attend [B, 1, n, n] bool | None (None = causal)) -> gate [B, H_gate, n]
    whose forward values are hard 0/1 flags and whose gradient is the sigmoid's.
    """

    kind = "attention"
    settings_class = AttentionSettings

    @classmethod
    def rotary_dims(cls, settings: AttentionSettings, head_dim: int) -> int:
        return (settings.head_dim or head_dim) if settings.rope else 0

    def __init__(self, hidden_size: int, out_heads: int, config: GateSettings, head_dim: int):
        super().__init__(config, out_heads)
        self.heads = self.settings.heads
        self.head_dim = self.settings.head_dim or head_dim
        if self.settings.rope and self.head_dim % 2:
            raise ValueError(f"GateConfig.head_dim: rotary gates need an even size, got {self.head_dim}")
        inner = self.heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, out_heads, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.xavier_uniform_(lin.weight)

    @property
    def bidirectional(self) -> bool:
        return self.settings.mode == "prompt_bidirectional"

    def scores(self, hidden: Tensor, position_embeddings=None, attend: Tensor | None = None) -> Tensor:
        """Raw gate scores ``[B, H_gate, n]`` (before gamma and the sigmoid), in fp32."""
        b, n, _ = hidden.shape
        x = in_gate_dtype(hidden, self.q_proj.weight)
        shape = (b, n, self.heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.settings.rope and position_embeddings is not None:
            cos, sin = _gate_rotary(*position_embeddings, self.head_dim)
            cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if attend is None:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attend)
        a = a.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.o_proj(a).float().transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, out_heads={self.out_heads}, "
                f"tau={self.config.tau}, gamma={self.config.gamma}, scale=1/{math.sqrt(self.head_dim):.3g}")
