"""Gate kind names -> module classes, written out by hand (``GateConfig.kind`` picks one).

Adding a kind: a ``Gate`` subclass taking ``(hidden_size, out_heads, config, head_dim)``, its
name in ``GateKind`` (``kvgate.gate.config``, which validates it) and one line here
(tests/gate/test_kinds.py checks that the two list the same names).
"""

from __future__ import annotations

from kvgate.gate.base import Gate
from kvgate.gate.config import ConfigError
from kvgate.gate.local import LinearGate, MLPGate
from kvgate.gate.module import AttentionGate

__all__ = ["GATES", "gate_class"]

GATES: dict[str, type[Gate]] = {
    "attention": AttentionGate,
    "mlp": MLPGate,
    "linear": LinearGate,
}


def gate_class(kind: str) -> type[Gate]:
    """The module class of a gate kind; ConfigError naming ``GateConfig.kind`` if unknown."""
    if kind not in GATES:
        raise ConfigError(f"GateConfig.kind: must be one of {', '.join(GATES)} (got {kind!r})")
    return GATES[kind]
