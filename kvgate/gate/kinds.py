"""Gate kind names -> module classes, written out by hand (no decorator magic): the one place
a kind is registered. ``GateConfig.kind`` is checked against these names, its fields are the
shared settings plus each kind's ``settings_class`` (``kvgate.gate.config``), and the package
exports each kind's classes from here (``kvgate.gate``).

Adding a kind: one file with a ``Gate`` subclass taking ``(hidden_size, out_heads, config,
head_dim)`` (its ``kind`` name, ``local``, ``settings_class``, ``rotary_dims`` and ``scores``),
one line here (docs/ARCHITECTURE.md, "Add a gate kind").
"""

from __future__ import annotations

from kvgate.gate.attention import AttentionGate
from kvgate.gate.base import Gate
from kvgate.gate.linear import LinearGate
from kvgate.gate.mlp import MLPGate
from kvgate.gate.settings import ConfigError

__all__ = ["GATES", "GATE_KINDS", "gate_class", "kind_exports"]

GATES: dict[str, type[Gate]] = {
    "attention": AttentionGate,
    "mlp": MLPGate,
    "linear": LinearGate,
}

# the kinds registered when the package loads (a kind added to GATES later is accepted too)
GATE_KINDS: tuple[str, ...] = tuple(GATES)


def gate_class(kind: str) -> type[Gate]:
    """The module class of a gate kind; ConfigError naming ``GateConfig.kind`` if unknown."""
    if kind not in GATES:
        raise ConfigError(f"GateConfig.kind: must be one of {', '.join(GATES)} (got {kind!r})")
    return GATES[kind]


def kind_exports() -> dict[str, type]:
    """Each registered kind's module class and settings class by name (``AttentionGate``,
    ``AttentionSettings``, ``MLPGate``, ...): what ``kvgate.gate`` exports of the kinds."""
    out: dict[str, type] = {}
    for cls in GATES.values():
        out[cls.__name__] = cls
        if cls.settings_class is not Gate.settings_class:
            out[cls.settings_class.__name__] = cls.settings_class
    return out
