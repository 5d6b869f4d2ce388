"""What a set of oracle labels belongs to: the base's weights and the blocks' tokens.

The architecture fingerprint (``kvgate.models.model_fingerprint``) lets a gate refuse a base of
another shape but, on purpose, not another fine-tune of the same shape. Labels are the base's
own attention, so they need its weights: ``base_fingerprint`` hashes them too (every tensor of
the state dict, in fp32, so a bf16 checkpoint read in fp32 keeps its fingerprint).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor, nn


def base_fingerprint(model: nn.Module) -> str:
    """32 hex chars: the architecture fingerprint and every weight of the base (call it on the
    base as loaded, before LoRA or gates are added). About a second per 100M parameters."""
    from kvgate.models import model_fingerprint

    digest = hashlib.blake2b(digest_size=16)
    digest.update(model_fingerprint(model.config).encode())
    for name, tensor in sorted(model.state_dict().items()):  # a loop over tensors
        digest.update(f"{name}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().data)
    return digest.hexdigest()


def block_layout(blocks: Tensor, context: int) -> dict[str, Any]:
    """The training blocks ``[N, seq_len]`` as labels are laid out over them: their count and
    length, the labelled tokens of each (``context``, the first ones) and a digest of every
    token id (another corpus, seed, tokenizer or packing changes it)."""
    ids = blocks.to("cpu", torch.int64).contiguous()
    return {"blocks": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "context": int(context),
            "tokens": hashlib.blake2b(ids.numpy().data, digest_size=16).hexdigest()}
