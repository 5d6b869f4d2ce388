"""Install gates into a LLaMA or Mistral model without copying modeling code.

``patch`` hangs a gate of ``GateConfig.kind`` (``kvgate.gate.kinds``: the Attention-Gate by
default) on every decoder layer's attention module as
``self_attn.kv_gate`` (so its parameters are named ``...self_attn.kv_gate...``) and routes the
model's attention through ``kvgate.models.dispatch``. The base parameters are not touched,
also when the model is wrapped by peft.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from kvgate.gate.base import Gate
from kvgate.gate.config import ConfigError, GateConfig
from kvgate.gate.kinds import gate_class
from kvgate.models import dispatch
from kvgate.models.arch import check_supported
from kvgate.models.errors import UnsupportedArchitectureError

# kept as the gate package's name for the one error type the model loader also raises
UnsupportedModelError = UnsupportedArchitectureError


def _base_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "get_base_model"):
        cfg = model.get_base_model().config
    return cfg


def check_gateable(model: nn.Module) -> None:
    check_supported(_base_config(model))
    if not dispatch.attention_modules(model):
        raise UnsupportedModelError("no attention modules with q_proj/layer_idx found to gate")


def patch(model: nn.Module, config: GateConfig | None = None) -> nn.Module:
    """Install gates (fp32, freshly initialised: ``reset_parameters`` of the kind) and the
    gated attention. Idempotent for the same config; a different config replaces the gates."""
    config = config or GateConfig()
    config.validate()
    check_gateable(model)
    cfg = _base_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out_heads = cfg.num_key_value_heads if config.target == "kv" else cfg.num_attention_heads
    rotary = int(head_dim * (getattr(cfg, "partial_rotary_factor", None) or 1.0))
    needed = gate_class(config.kind).rotary_dims(config.kind_settings(), head_dim)
    if needed > rotary:
        # a rotary gate reuses the model's position tables, which have only `rotary` dims
        raise ConfigError(f"GateConfig.head_dim: {needed} exceeds this model's rotary "
                          f"dimension {rotary}; use head_dim <= {rotary} or rope: false")
    dispatch.install(model)
    for module in dispatch.attention_modules(model):
        existing = getattr(module, "kv_gate", None)
        if existing is None or existing.config != config:
            device = module.q_proj.weight.device if hasattr(module.q_proj, "weight") else None
            gate = gate_class(config.kind)(cfg.hidden_size, out_heads, config, head_dim)
            module.kv_gate = gate.to(device=device, dtype=torch.float32)
    router = dispatch.router(model)
    router.records.clear()
    router.prompt_mask, router.prefix = None, None
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Remove the gates and restore the original attention implementation."""
    for module in dispatch.attention_modules(model):
        if hasattr(module, "kv_gate"):
            del module.kv_gate
    dispatch.uninstall(model)
    return model


def gate_modules(model: nn.Module) -> list[Gate]:
    """Installed gates in layer order (empty when the model is not patched)."""
    return [m.kv_gate for m in dispatch.attention_modules(model) if hasattr(m, "kv_gate")]


def gate_config(model: nn.Module) -> GateConfig | None:
    gates = gate_modules(model)
    return gates[0].config if gates else None


@contextmanager
def gates_open(model: nn.Module) -> Iterator[None]:
    """Every flag forced to 1: the model computes exactly as the unpatched base (the
    full-cache teacher for distillation, and LoRA-only training)."""
    gates = gate_modules(model)
    before = [g.active for g in gates]
    for g in gates:
        g.active = False
    try:
        yield
    finally:
        for g, a in zip(gates, before):
            g.active = a


@contextmanager
def router_setting(model: nn.Module, **settings: object) -> Iterator[dispatch.Router]:
    """The model's router (installed if it was not) with ``settings`` (its fields: the gate's
    session settings) for the block, the earlier values back after it, also on an error."""
    router = dispatch.install(model)
    for name in settings:
        if not hasattr(router, name):
            raise AttributeError(f"the router has no setting {name!r}")
    before = {name: getattr(router, name) for name in settings}
    for name, value in settings.items():
        setattr(router, name, value)
    try:
        yield router
    finally:
        for name, value in before.items():
            setattr(router, name, value)


def prompt_segment(model: nn.Module, prompt_mask: Tensor | None):
    """Mark the prompt ``[B, n]`` bool. ``prompt_bidirectional`` gates attend bidirectionally
    over the prompt only; with ``prefill="full"`` the prompt attends fully and only later tokens
    read the gated prompt. In both, tokens after the prompt are never gated; a causal eq. 5 gate
    (the default) ignores the mark."""
    return router_setting(model, prompt_mask=prompt_mask)


def recorded_scores(model: nn.Module, on: bool = True):
    """While inside (and ``on``), each gated layer's record keeps its gate's raw scores, with a
    gradient that reaches that gate only (``GateRecord.scores``; the oracle objective)."""
    return router_setting(model, gate_scores=bool(on))


@contextmanager
def gate_graph_only(model: nn.Module, on: bool = True) -> Iterator[None]:
    """While inside (and ``on``), forwards run without autograd except in the gates, whose
    records (keep flags, raw scores) keep a graph to their own parameters: the step of a
    recipe whose losses all read the gates (the oracle loss and the eviction loss, as KVzap
    trains its per-layer scorers, arXiv:2601.07891) then costs a forward, not a backward
    through the model. The gates still decide what the forward's attention sees. Wrap the
    forward only: the losses computed from the records need autograd back."""
    with router_setting(model, gate_graph=bool(on)), torch.no_grad() if on else nullcontext():
        yield


def set_gates_trainable(model: nn.Module, trainable: bool = True) -> list[nn.Parameter]:
    params = [p for g in gate_modules(model) for p in g.parameters()]
    for p in params:
        p.requires_grad_(trainable)
    return params
