"""What every evaluation module needs first: the one error type of bad evaluation input, and
the few facts read off a model or a tokenizer (layers and KV heads, device, token ids of a
text; the padding id is ``kvgate.models.load.pad_id``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvgate.errors import KVGateError

if TYPE_CHECKING:  # the configs import this module to build the flags: no torch until run
    import torch
    from torch import nn


class EvalError(KVGateError, ValueError):
    """Bad evaluation input (items, modes, budgets, files); the message says which."""


def model_shape(model: nn.Module) -> tuple[int, int]:
    """(decoder layers, KV heads) of a LLaMA/Mistral model (peft-wrapped or not)."""
    cfg = model.config
    getter = getattr(cfg, "get_text_config", None)
    cfg = getter(decoder=True) if getter is not None else cfg
    heads = int(cfg.num_attention_heads)
    return int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", None) or heads)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text``; ``special`` adds what the tokenizer adds to a sequence (BOS)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])
