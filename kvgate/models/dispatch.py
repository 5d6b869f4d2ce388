"""One attention implementation, registered with transformers, that routes each call.

Instead of copying modeling files, kvgate registers an attention function named ``"kvgate"``
in transformers' ``AttentionInterface`` and switches the model to it (``install``).

State, passed explicitly:
- a ``Router`` per installed model holds what lasts across forwards (hook handles, the
  attention implementation to restore, an observer, the gate's session settings);
- a ``ForwardContext`` is created when a forward of the decoder starts and is handed down
  through transformers' own keyword arguments (``kvgate_context``) to every decoder layer,
  attention module and attention call; it records what the attention function cannot see
  from its arguments (each layer's normalised input, rotary tables and cache) and is dropped
  with the forward's other locals when the forward returns.

Routing, per attention call (``kvgate_attention``), in this order:
1. the forward's cache computes attention itself (an ``AttentionHandler``, e.g.
   ``CompressedCache``: prefill with a policy, decode over the ragged store);
2. the layer carries an Attention-Gate that wants this call (a ``GatedRoute``: training,
   masked evaluation);
3. plain SDPA, so an installed-but-idle model computes exactly as the original.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

IMPL = "kvgate"
CONTEXT_KWARG = "kvgate_context"  # the keyword the context travels under
ROUTER_ATTR = "kvgate_router"  # the decoder's attribute holding its Router
GATE_ATTR = "kv_gate"  # where a gate hangs on an attention module (names its parameters)


@dataclass
class LayerCall:
    """What one attention module's forward received besides q/k/v (recorded by a pre-hook)."""

    hidden: Tensor | None  # [B, n, D] the normalised layer input (what a gate reads)
    position_embeddings: tuple[Tensor, Tensor] | None  # rotary (cos, sin) of this forward
    cache: Any  # this forward's past_key_values


@dataclass
class ForwardContext:
    """The state of one forward: every layer's ``LayerCall`` so far, and the router."""

    router: Router
    calls: dict[int, LayerCall] = field(default_factory=dict)
    # per attention-mask object, what the layers derive from it alike (its real tokens, a
    # gate's own n x n mask, the Triton kernels' mask vectors): transformers hands every layer
    # of one attention type the same mask tensor, so the first layer derives and the others
    # read (on a GPU each derivation was a device sync per layer). The mask is held with its
    # memo so that its id cannot be reused while the forward lasts.
    memos: dict[int, tuple[Tensor | None, dict]] = field(default_factory=dict)

    def call(self, layer_idx: int) -> LayerCall:
        return self.calls.get(layer_idx) or LayerCall(None, None, None)

    def memo(self, mask: Tensor | None) -> dict:
        """The memo of ``mask`` (a layer's attention mask, None included) in this forward."""
        # an id found here is the same object: the held mask keeps its id from being reused
        return self.memos.setdefault(id(mask), (mask, {}))[1]


class AttentionHandler:
    """A cache that computes its layers' attention itself (``CompressedCache``): the router
    hands it every attention call of a forward that carries it as ``past_key_values``."""

    def attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None,
               hidden: Tensor | None = None, position_embeddings: Any = None,
               **kwargs: Any) -> tuple[Tensor, None]:
        """query [B, H, r, d], key/value [B, H_kv, r, d] post-RoPE, hidden [B, r, D] (the
        layer's normalised input). Returns ``(out [B, r, H, d], None)`` like transformers'."""
        raise NotImplementedError


class GatedRoute(nn.Module):
    """A module hung on an attention module as ``kv_gate`` that may take over its attention
    (the Attention-Gate)."""

    def routes(self, router: Router) -> bool:
        """Whether this layer's attention goes through ``gated_attend`` now."""
        raise NotImplementedError

    def gated_attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None,
                     context: ForwardContext, **kwargs: Any) -> tuple[Tensor, None]:
        raise NotImplementedError


Tap = Callable[[nn.Module, Tensor, Tensor, Tensor, "Tensor | None", "float | None", LayerCall],
               None]


@dataclass
class Router:
    """What an installed model keeps across forwards."""

    handles: list[Any] = field(default_factory=list)  # hook handles, removed by uninstall
    restore: list[tuple[Any, str]] = field(default_factory=list)  # (config, previous impl)
    tap: Tap | None = None  # an observer of every attention call (warm-start labels, analysis)
    # the gate's session settings, written by kvgate.gate (typed there):
    prompt_mask: Tensor | None = None  # [B, n] bool: the prompt of the coming forwards
    prefix: dict[int, Any] | None = None  # one-shot training's stored prompt, per layer
    records: dict[int, Any] = field(default_factory=dict)  # the last forward's gate decisions
    gate_scores: bool = False  # records also keep each gate's raw scores (the oracle objective)
    # the gates build their autograd graph even inside torch.no_grad() (a step whose only
    # losses read the gates: kvgate.gate.patch.gate_graph_only)
    gate_graph: bool = False


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    found = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    return sorted(found, key=lambda m: m.layer_idx)


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module whose forward runs the decoder layers (LlamaModel and kin)."""
    attn = set(map(id, attention_modules(model)))
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(
                id(getattr(layer, "self_attn", None)) in attn for layer in layers):
            return m
    return None


def router(model: nn.Module) -> Router | None:
    """The router of an installed model (None when kvgate is not installed)."""
    decoder = _decoder(model)
    return None if decoder is None else getattr(decoder, ROUTER_ATTR, None)


def _begin_forward(decoder: nn.Module, args: tuple, kwargs: dict):
    # a fresh context per forward, handed down through transformers' **kwargs; the router is
    # read from the decoder itself so that a copied model uses its own
    kwargs[CONTEXT_KWARG] = ForwardContext(getattr(decoder, ROUTER_ATTR))
    return args, kwargs


def _record_call(router_: Router, module: nn.Module, args: tuple, kwargs: dict):
    context = kwargs.get(CONTEXT_KWARG)
    if context is None:  # the attention module called on its own, outside a decoder forward
        context = kwargs[CONTEXT_KWARG] = ForwardContext(router_)
    context.calls[module.layer_idx] = LayerCall(
        kwargs.get("hidden_states", args[0] if args else None),
        kwargs.get("position_embeddings"), kwargs.get("past_key_values"))
    return args, kwargs


def kvgate_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs):
    context: ForwardContext | None = kwargs.pop(CONTEXT_KWARG, None)
    if context is None:  # not installed on this model: behave as SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    call = context.call(module.layer_idx)
    if context.router.tap is not None:  # observers see q/k/v and change nothing
        context.router.tap(module, query, key, value, attention_mask, scaling, call)
    if isinstance(call.cache, AttentionHandler):
        return call.cache.attend(module, query, key, value, attention_mask, scaling=scaling,
                                 hidden=call.hidden, position_embeddings=call.position_embeddings,
                                 context=context, **kwargs)
    gate = getattr(module, GATE_ATTR, None)
    if isinstance(gate, GatedRoute) and gate.routes(context.router):
        return gate.gated_attend(module, query, key, value, attention_mask, scaling, context,
                                 **kwargs)
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


def install(model: nn.Module) -> Router:
    """Route the model's attention through ``kvgate_attention`` (idempotent); its Router."""
    decoder = _decoder(model)
    if decoder is None:
        raise ValueError(f"{type(model).__name__}: no decoder with attention layers found")
    existing = getattr(decoder, ROUTER_ATTR, None)
    if existing is not None:
        return existing
    new = Router()
    for cfg in _configs(model):
        if cfg._attn_implementation != IMPL:
            new.restore.append((cfg, cfg._attn_implementation))
            cfg._attn_implementation = IMPL
    new.handles.append(decoder.register_forward_pre_hook(_begin_forward, with_kwargs=True))
    for module in attention_modules(model):
        new.handles.append(module.register_forward_pre_hook(
            lambda m, a, k: _record_call(new, m, a, k), with_kwargs=True))
    setattr(decoder, ROUTER_ATTR, new)
    return new


def uninstall(model: nn.Module) -> nn.Module:
    """Undo ``install``: original attention implementation, hooks removed."""
    decoder = _decoder(model)
    found = None if decoder is None else getattr(decoder, ROUTER_ATTR, None)
    if found is None:
        return model
    for cfg, previous in found.restore:
        cfg._attn_implementation = previous
    for handle in found.handles:
        handle.remove()
    delattr(decoder, ROUTER_ATTR)
    return model


@contextmanager
def tapped(model: nn.Module, tap: Tap) -> Iterator[None]:
    """Call ``tap(module, query, key, value, attention_mask, scaling, call)`` on every attention
    call inside the block (post-RoPE q/k as the attention sees them; ``call`` a LayerCall)."""
    found = install(model)
    before, found.tap = found.tap, tap
    try:
        yield
    finally:
        found.tap = before
