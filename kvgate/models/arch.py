"""Which architectures kvgate can gate, and a fingerprint that identifies one.

The fingerprint lets a gated checkpoint refuse a base model of another shape: it hashes
only the fields that decide tensor shapes and positions (not weights, not generation
settings), so two fine-tunes of one architecture share a fingerprint on purpose.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvgate.models.errors import DTypeError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Architecture-defining fields; a missing one hashes as None so old/new configs stay comparable.
_FINGERPRINT_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "tie_word_embeddings", "sliding_window",
)


def check_supported(config: Any) -> None:
    """Raise ``UnsupportedArchitectureError`` unless ``config.model_type`` is LLaMA or Mistral."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported for gating; kvgate supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (pass require_supported=False to load it anyway)"
        )


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` / ``"float32"`` / ``"fp32"`` / ``"torch.bfloat16"`` ... -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise DTypeError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}")


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def _rope(config: Any) -> Any:
    # transformers 5 keeps rope settings in ``rope_parameters``; older configs in rope_theta/scaling
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(config, "rope_theta", None),
                "rope_scaling": getattr(config, "rope_scaling", None)}
    return rope


def architecture_fields(config: Any) -> dict[str, Any]:
    """The config fields that define the architecture (what the fingerprint hashes)."""
    fields = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    fields["head_dim"] = _head_dim(config)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = config.num_attention_heads
    fields["rope"] = _rope(config)
    return fields


def model_fingerprint(config: Any) -> str:
    """Short stable hash (16 hex chars) of ``architecture_fields(config)``."""
    blob = json.dumps(architecture_fields(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
