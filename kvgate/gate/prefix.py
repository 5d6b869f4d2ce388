"""One-shot training in two passes: the prompt once without autograd, then the continuation.

With ``GateConfig.prefill="full"`` the prompt attends with full attention, so its hidden
states and K/V never depend on the gates, and in gates-only training nothing trainable acts on
them. A whole-block forward still carries every prompt position through autograd. Here the
prompt runs once under ``no_grad``; each gated layer keeps its input (what the gate reads) and
its K/V, and the continuation then runs over them: the gates flag the stored prompt (with
gradient), and the continuation's queries read the gated prompt K/V plus their own. Loss and
gradients are those of the whole-block forward; the backward covers the continuation only, and
so does a distillation teacher, which reads the same stored prompt with every gate open.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvgate.attention.gated import gated_attention
from kvgate.gate.apply import compute_gate
from kvgate.models import dispatch


@dataclass
class PrefixSlot:
    """What one gated layer leaves in the prompt pass and reads in the continuation pass."""

    hidden: Tensor | None = None  # [B, P, D] the layer input the gate reads
    position_embeddings: tuple[Tensor, Tensor] | None = None  # rotary tables of the prompt
    key: Tensor | None = None  # [B, H_kv, P, d] as the attention sees it (after RoPE)
    value: Tensor | None = None


def split_point(input_ids: Tensor, attention_mask: Tensor | None, prompt_mask: Tensor | None,
                labels: Tensor | None) -> int | None:
    """The prompt length P when the batch can run in two passes, else None: every row is the
    same P prompt tokens then a continuation, nothing is padded, and no label falls where only
    a prompt position's logits would predict it (labels 1 .. P-1)."""
    if prompt_mask is None or prompt_mask.dim() != 2:
        return None
    n = input_ids.shape[1]
    p = int(prompt_mask[0].sum())
    if not 2 <= p < n:
        return None
    if not bool(prompt_mask[:, :p].all()) or bool(prompt_mask[:, p:].any()):
        return None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return None
    if labels is not None and bool((labels[:, 1:p] != -100).any()):
        return None
    return p


@contextmanager
def encoded_prompt(model: nn.Module, prompt_ids: Tensor) -> Iterator[Tensor]:
    """Run the prompt ``[B, P]`` once without autograd and yield the last prompt position's
    logits ``[B, 1, V]``; inside the block, a forward of the continuation (``position_ids``
    starting at P) reads the stored prompt in every gated layer."""
    router = dispatch.install(model)
    router.prefix = {m.layer_idx: PrefixSlot() for m in dispatch.attention_modules(model)
                     if isinstance(getattr(m, dispatch.GATE_ATTR, None), nn.Module)}
    try:
        with torch.no_grad():
            last = model(input_ids=prompt_ids, use_cache=False, logits_to_keep=1).logits
        yield last
    finally:
        router.prefix = None


def continuation_positions(prompt_len: int, continuation_ids: Tensor) -> Tensor:
    """``position_ids`` [B, C] of the continuation after a ``prompt_len``-token prompt."""
    b, c = continuation_ids.shape
    pos = torch.arange(prompt_len, prompt_len + c, device=continuation_ids.device)
    return pos[None].expand(b, c)


def prefix_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     scaling: float | None, context: dispatch.ForwardContext):
    """One gated layer in either pass; returns (output [B, n, H, d], None) like transformers'."""
    gate_mod = module.kv_gate
    slots = context.router.prefix
    slot = slots[module.layer_idx]
    if slot.key is None:  # the prompt pass: full attention, as a one-shot prefill encodes it
        call = context.call(module.layer_idx)
        slot.hidden, slot.position_embeddings = call.hidden, call.position_embeddings
        slot.key, slot.value = key, value
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling)
    b, _, c, _ = query.shape
    p = slot.key.shape[2]
    device = query.device
    prompt = torch.zeros(b, p + c, dtype=torch.bool, device=device)
    prompt[:, :p] = True
    if gate_mod.active:
        on_prompt = prompt[:, :p]  # all true: nothing to read back (all_real)
        record = compute_gate(module, slot.hidden, slot.position_embeddings, on_prompt,
                              on_prompt, own_scores=context.router.gate_scores,
                              graph=context.router.gate_graph, all_real=True)
        context.router.records[module.layer_idx] = record
        flags = torch.cat([record.gate, record.gate.new_ones(b, record.gate.shape[1], c)], -1)
    else:  # gates open (the distillation teacher): every prompt entry visible
        flags = torch.ones(b, gate_mod.out_heads, p + c, device=device)
    keys = torch.cat([slot.key.to(key.dtype), key], 2)
    values = torch.cat([slot.value.to(value.dtype), value], 2)
    out = gated_attention(query, keys, values, flags, None, scaling=scaling,
                          recent=gate_mod.config.recent, prompt=prompt,
                          kernel=gate_mod.config.kernel)
    return out.transpose(1, 2).contiguous(), None
