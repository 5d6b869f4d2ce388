"""What every gate kind shares: hard keep flags with the sigmoid's gradient, the switch that
opens it, and the route into the gated attention (kvgate.models.dispatch)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from kvgate.attention.gated import gated_attention
from kvgate.attention.masks import memoised, new_token_validity
from kvgate.gate.apply import compute_gate, straight_through
from kvgate.gate.prefix import prefix_attention
from kvgate.gate.settings import GateSettings, KindSettings, read_settings
from kvgate.models.dispatch import ForwardContext, GatedRoute, Router


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
    any of them alike (``kvgate.gate.kinds``). ``config`` is the flat ``GateConfig`` (the shared
    settings: ``self.config.tau``, ...); the kind's own fields are read into its
    ``settings_class`` as ``self.settings``.
    """

    kind: str = ""
    local: bool = False
    settings_class: ClassVar[type[KindSettings]] = KindSettings

    @classmethod
    def rotary_dims(cls, settings: KindSettings, head_dim: int) -> int:
        """How many of the model's rotary dimensions a gate of this kind with ``settings``
        rotates its own queries and keys with, on a model of ``head_dim`` (0: none). ``patch``
        checks them against the model's; a policy then asks for the forward's tables."""
        return 0

    def __init__(self, config: GateSettings, out_heads: int) -> None:
        super().__init__()
        self.config = config
        self.settings = read_settings(self.settings_class, config)
        self.out_heads = out_heads
        # Off while the gate should not act (gates-open teacher, LoRA-only training, decode).
        self.active = True

    @property
    def bidirectional(self) -> bool:
        """Whether the gate's own attention sees the whole prompt, so that only the prompt's
        flags count (a local kind attends to nothing: never)."""
        return False

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


def gated_layer_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, scaling: float | None,
                          context: ForwardContext, **_: object):
    """Gated attention for one layer; returns (output [B, n, H, d], None) like transformers'."""
    router = context.router
    if router.prefix is not None and module.layer_idx in router.prefix:
        # one-shot training's two passes (kvgate.gate.prefix)
        return prefix_attention(module, query, key, value, scaling, context)
    b, _, n, _ = query.shape
    if key.shape[2] != n:
        # A plain cache holding earlier tokens: the gate defines eviction at prefill only, and a
        # plain cache cannot forget, so decode runs ungated here. Gated generation uses
        # CompressedCache with the attention_gate policy, which stores only kept entries.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
    # the cache's reading of the mask (a padding query does not see itself): training and a
    # cached prefill agree on which tokens are real
    memo = context.memo(attention_mask)
    valid = memoised(memo, ("valid", b, n),
                     lambda: new_token_validity(attention_mask, b, n, query.device))
    call = context.call(module.layer_idx)
    record = compute_gate(module, call.hidden, call.position_embeddings, valid,
                          router.prompt_mask, own_scores=router.gate_scores,
                          graph=router.gate_graph, all_real=attention_mask is None, memo=memo)
    router.records[module.layer_idx] = record
    prompt = None
    if module.kv_gate.config.prefill == "full":
        # one-shot: without a marked prompt the whole input is the prompt, encoded in full
        prompt = router.prompt_mask
        if prompt is None:
            prompt = torch.ones(b, n, dtype=torch.bool, device=query.device)
    out = gated_attention(query, key, value, record.gate, attention_mask, scaling=scaling,
                          recent=module.kv_gate.config.recent, prompt=prompt,
                          kernel=module.kv_gate.config.kernel, memo=memo)
    return out.transpose(1, 2).contiguous(), None
