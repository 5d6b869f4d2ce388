"""Gate kind names -> module classes, written out by hand (no decorator magic): the one place
a kind is registered (``GateConfig.kind`` picks one and is checked against these names).

Adding a kind: one file with a ``Gate`` subclass taking ``(hidden_size, out_heads, config,
head_dim)`` (its ``kind`` name, ``local``, ``uses_rope`` and ``scores``), one line here
(docs/ARCHITECTURE.md, "Add a gate kind").
"""

from __future__ import annotations

from kvgate.gate.base import Gate
from kvgate.gate.local import LinearGate, MLPGate
from kvgate.gate.module import AttentionGate
from kvgate.gate.settings import ConfigError

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
