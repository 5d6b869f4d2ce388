"""One attention implementation, registered with transformers, that routes each call.

Instead of copying modeling files, kvgate registers an attention function named ``"kvgate"``
in transformers' ``AttentionInterface`` and switches the model to it. A forward pre-hook on
every attention module records what the attention function cannot see from its arguments:
the normalised layer input (the gate reads it) and the cache object of this forward.

Routing, per call:
1. the cache of this forward handles attention itself (``CompressedCache``: prefill with a
   policy, decode over the ragged store) -> ``cache.attend(...)``;
2. the module carries an active Attention-Gate -> gated attention (training, masked eval);
3. otherwise plain SDPA, so an installed-but-idle model equals the original.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

IMPL = "kvgate"
_HOOK_ATTR = "_kvgate_hook"
_CTX_ATTR = "_kvgate_ctx"
_PREV_IMPL_ATTR = "_kvgate_prev_attn_impl"
_TAP_ATTR = "_kvgate_tap"
_CLEAR_ATTR = "_kvgate_clear_hook"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    found = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    return sorted(found, key=lambda m: m.layer_idx)


def _record_context(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    module.__dict__[_CTX_ATTR] = {
        "hidden": hidden,
        "cache": kwargs.get("past_key_values"),
        "position_embeddings": kwargs.get("position_embeddings"),
    }


def _clear_contexts(model: nn.Module, *_: Any) -> None:
    # the recorded hidden states and cache reference are only needed during the forward;
    # dropping them afterwards frees activations (~0.3 GB for SmolLM2 at 4k) and the cache
    for module in attention_modules(model):
        module.__dict__.pop(_CTX_ATTR, None)


def context(module: nn.Module) -> dict[str, Any]:
    return module.__dict__.get(_CTX_ATTR, {})


def kvgate_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs):
    ctx = context(module)
    tap = module.__dict__.get(_TAP_ATTR)
    if tap is not None:  # observers (warm-start labels, analysis) see q/k/v, change nothing
        tap(module, query, key, value, attention_mask, scaling, ctx)
    cache = ctx.get("cache")
    if cache is not None and getattr(cache, "handles_attention", False):
        return cache.attend(module, query, key, value, attention_mask, scaling=scaling,
                            hidden=ctx.get("hidden"), **kwargs)
    gate = getattr(module, "kv_gate", None)
    # a stored prompt (one-shot training's two passes) is read also with the gates open
    if gate is not None and (gate.active or gate.__dict__.get("prefix") is not None):
        from kvgate.gate.apply import gated_layer_attention

        return gated_layer_attention(module, query, key, value, attention_mask,
                                     scaling=scaling, ctx=ctx, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


AttentionInterface.register(IMPL, kvgate_attention)
AttentionMaskInterface.register(IMPL, sdpa_mask)


def _configs(model: nn.Module) -> list[Any]:
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextmanager
def tapped(model: nn.Module, tap) -> Iterator[None]:
    """Call ``tap(module, query, key, value, attention_mask, scaling, ctx)`` on every attention
    call inside the block (post-RoPE q/k as the attention sees them)."""
    install(model)
    modules = attention_modules(model)
    for m in modules:
        m.__dict__[_TAP_ATTR] = tap
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop(_TAP_ATTR, None)


def install(model: nn.Module) -> nn.Module:
    """Route the model's attention through ``kvgate_attention`` (idempotent)."""
    for cfg in _configs(model):
        if cfg._attn_implementation != IMPL:
            cfg.__dict__[_PREV_IMPL_ATTR] = cfg._attn_implementation
            cfg._attn_implementation = IMPL
    for module in attention_modules(model):
        if _HOOK_ATTR not in module.__dict__:
            module.__dict__[_HOOK_ATTR] = module.register_forward_pre_hook(
                _record_context, with_kwargs=True)
    if _CLEAR_ATTR not in model.__dict__:
        model.__dict__[_CLEAR_ATTR] = model.register_forward_hook(_clear_contexts)
    return model


def uninstall(model: nn.Module) -> nn.Module:
    """Undo ``install``: original attention implementation, hooks removed."""
    for cfg in _configs(model):
        prev = cfg.__dict__.pop(_PREV_IMPL_ATTR, None)
        if prev is not None:
            cfg._attn_implementation = prev
    clear = model.__dict__.pop(_CLEAR_ATTR, None)
    if clear is not None:
        clear.remove()
    for module in attention_modules(model):
        handle = module.__dict__.pop(_HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
        module.__dict__.pop(_CTX_ATTR, None)
    return model
