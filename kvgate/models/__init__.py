"""Base-model loading (alias, local folder, GGUF, hub id) and architecture checks."""

from kvgate.models.arch import (
    SUPPORTED_MODEL_TYPES,
    architecture_fields,
    check_supported,
    model_fingerprint,
    parse_dtype,
)
from kvgate.models.errors import DTypeError, ModelLoadError, UnsupportedArchitectureError
from kvgate.models.gguf import cache_root, prepare_embedded
from kvgate.models.load import hub_offline_reason, load_base, load_tokenizer, resolve_model_id

__all__ = [
    "SUPPORTED_MODEL_TYPES", "DTypeError", "ModelLoadError", "UnsupportedArchitectureError",
    "architecture_fields", "cache_root", "check_supported", "hub_offline_reason", "load_base",
    "load_tokenizer", "model_fingerprint", "parse_dtype", "prepare_embedded", "resolve_model_id",
]
