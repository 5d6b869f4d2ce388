"""Learned gates: the kinds (Attention-Gate, mlp, linear; registered in ``kvgate.gate.kinds``),
the straight-through flags, patching and the eviction loss.

Each registered kind's module and settings classes (``AttentionGate``, ``AttentionSettings``,
``MLPGate``, ``MLPSettings``, ``LinearGate``, ...) are exported from the registry, so a kind's
one registry line also makes them ``kvgate.gate.NAME``."""

from typing import Any

from kvgate.gate.apply import straight_through
from kvgate.gate.base import Gate
from kvgate.gate.config import GATE_KINDS, ConfigError, GateConfig
from kvgate.gate.kinds import GATES, gate_class, kind_exports
from kvgate.gate.loss import (
    clear_records,
    eviction_loss,
    gate_records,
    last_flags,
    retention_stats,
)
from kvgate.gate.patch import (
    UnsupportedModelError,
    check_gateable,
    gate_config,
    gate_graph_only,
    gate_modules,
    gates_open,
    patch,
    prompt_segment,
    recorded_scores,
    set_gates_trainable,
    unpatch,
)
from kvgate.gate.settings import KindSettings


def __getattr__(name: str) -> Any:
    found = kind_exports().get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found


__all__ = [
    "GATES",
    "GATE_KINDS",
    "ConfigError",
    "Gate",
    "GateConfig",
    "KindSettings",
    "UnsupportedModelError",
    "check_gateable",
    "clear_records",
    "eviction_loss",
    "gate_class",
    "gate_config",
    "gate_graph_only",
    "gate_modules",
    "gate_records",
    "gates_open",
    "last_flags",
    "patch",
    "prompt_segment",
    "recorded_scores",
    "retention_stats",
    "set_gates_trainable",
    "straight_through",
    "unpatch",
]
__all__.extend(kind_exports())
