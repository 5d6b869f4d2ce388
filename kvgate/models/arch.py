"""Which architectures kvgate can gate, and a fingerprint that identifies one.

Supported: LLaMA, Mistral, Qwen2 and Qwen3. kvgate routes attention through transformers'
``AttentionInterface`` (``kvgate.models.dispatch``), so whatever a family does to q/k before
attention (Qwen2's q/k/v biases, Qwen3's per-head RMSNorm of q and k before RoPE) has already
happened when the router sees them. Refused: models whose layers mix sliding-window and global
attention (Gemma 2/3, Qwen2 with ``use_sliding_window`` on some layers), because the gate's
training objective and the evaluation read one window for the whole model.

The fingerprint lets a gated checkpoint refuse a base model of another shape: it hashes
only the fields that decide tensor shapes and positions (not weights, not generation
settings), so two fine-tunes of one architecture share a fingerprint on purpose. The fields
added for Qwen2/Qwen3 (q/k/v bias, q/k norm, per-layer attention types) enter only for those
model types, so LLaMA and Mistral fingerprints are what they were.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from kvgate.models.errors import DTypeError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

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
    """Raise ``UnsupportedArchitectureError`` (one line) unless ``config`` is a LLaMA, Mistral,
    Qwen2 or Qwen3 model whose layers all use one attention kind."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    layer_kinds = set(getattr(config, "layer_types", None) or ())
    if len(layer_kinds) > 1 or str(model_type).startswith("gemma"):
        why = (f"its layers mix {' and '.join(sorted(layer_kinds))}, and kvgate needs one "
               "attention kind in every layer" if len(layer_kinds) > 1 else
               "the Gemma family (sliding-window/global layer mixes, soft-capped attention) is "
               "not wired into kvgate's attention")
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported for gating: {why}; kvgate supports "
            f"{supported} (pass require_supported=False to load it anyway)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported for gating; kvgate supports "
            f"{supported} (pass require_supported=False to load it anyway)"
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


def _qwen_fields(config: Any) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases (not a config field); Qwen3 reads attention_bias and
    # always normalises q and k per head before RoPE
    qwen3 = config.model_type == "qwen3"
    return {
        "attention_bias": bool(getattr(config, "attention_bias", False)) if qwen3 else True,
        "qk_norm": qwen3,
        "layer_types": list(getattr(config, "layer_types", None) or ()),
    }


# Extra fields per model type, added only for these types (older fingerprints stay valid).
_TYPE_FIELDS = {"qwen2": _qwen_fields, "qwen3": _qwen_fields}


def architecture_fields(config: Any) -> dict[str, Any]:
    """The config fields that define the architecture (what the fingerprint hashes)."""
    fields = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    fields["head_dim"] = _head_dim(config)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = config.num_attention_heads
    fields["rope"] = _rope(config)
    extra = _TYPE_FIELDS.get(getattr(config, "model_type", None))
    if extra is not None:
        fields.update(extra(config))
    return fields


def model_fingerprint(config: Any) -> str:
    """Short stable hash (16 hex chars) of ``architecture_fields(config)``."""
    blob = json.dumps(architecture_fields(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
