"""kvgate: learned KV-cache eviction (Attention-Gate) and heuristic policies on one cache."""

from kvgate.gate import GateConfig, patch, unpatch

__version__ = "0.1.0"
__all__ = ["GateConfig", "patch", "unpatch", "__version__"]
