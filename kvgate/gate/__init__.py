"""Learned gates: the kinds (Attention-Gate, mlp, linear), the straight-through flags,
patching and the eviction loss."""

from kvgate.gate.base import Gate
from kvgate.gate.config import GATE_KINDS, ConfigError, GateConfig
from kvgate.gate.kinds import GATES, gate_class
from kvgate.gate.local import LinearGate, MLPGate
from kvgate.gate.loss import (
    clear_records,
    eviction_loss,
    gate_records,
    last_flags,
    retention_stats,
)
from kvgate.gate.module import AttentionGate, straight_through
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

__all__ = [
    "GATES",
    "GATE_KINDS",
    "AttentionGate",
    "ConfigError",
    "Gate",
    "GateConfig",
    "LinearGate",
    "MLPGate",
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
