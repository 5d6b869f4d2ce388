"""kvgate: learned KV-cache eviction (Attention-Gate) and heuristic policies on one cache."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["GateConfig", "__version__", "patch", "unpatch"]


def __getattr__(name: str) -> Any:
    # lazy: `import kvgate.data` should not pay for importing torch and transformers
    if name in ("GateConfig", "patch", "unpatch"):
        from kvgate import gate

        return getattr(gate, name)
    raise AttributeError(f"module 'kvgate' has no attribute {name!r}")
