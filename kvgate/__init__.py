"""kvgate: learned KV-cache eviction (Attention-Gate) and heuristic policies on one cache.

The names below are what most users need; each is imported on first use, so ``import kvgate``
stays light (``kvgate.data`` or the command line do not pay for torch and transformers)::

    import kvgate

    model, tok = kvgate.load_base("smollm2-135m")           # alias, folder, .gguf or hub id
    engine = kvgate.Engine(model, tok, kvgate.get_policy("snapkv"), budget=0.5)
    model, tok = kvgate.load_gated("runs/cpt_recipe/gated")  # an exported gated checkpoint
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "KVGateError": "kvgate.errors",
    "load_base": "kvgate.models.load",
    "load_gated": "kvgate.checkpoint",
    "export_kvzap": "kvgate.checkpoint",
    "Engine": "kvgate.inference.engine",
    "get_policy": "kvgate.policies.registry",
    "list_policies": "kvgate.policies.registry",
    "Budget": "kvgate.policies.base",
    "CompressedCache": "kvgate.cache.compressed",
    "GateConfig": "kvgate.gate.config",
    "patch": "kvgate.gate.patch",
    "unpatch": "kvgate.gate.patch",
}

__all__ = [
    "Budget", "CompressedCache", "Engine", "GateConfig", "KVGateError", "__version__",
    "export_kvzap", "get_policy", "list_policies", "load_base", "load_gated", "patch", "unpatch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
