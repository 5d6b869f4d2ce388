"""Typed, validated configuration of the learned gates: ``GateConfig``, the settings of
:mod:`kvgate.gate.settings` checked against the registered kinds as well (``kind`` picks the
gate's architecture among ``kvgate.gate.kinds.GATES``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.gate.kinds import GATES, gate_class
from kvgate.gate.settings import (
    ConfigError,
    GateKernel,
    GateKind,
    GateMode,
    GatePrefill,
    GateSettings,
    GateTarget,
)

__all__ = ["GATE_KINDS", "ConfigError", "GateConfig", "GateKernel", "GateKind", "GateMode",
           "GatePrefill", "GateTarget"]

# the kinds registered when the package loads (a kind added to GATES later is accepted too)
GATE_KINDS: tuple[str, ...] = tuple(GATES)


@dataclass
class GateConfig(GateSettings):
    """Gate hyper-parameters.

    Defaults follow the Attention-Gate paper's continual pre-training setting (tau 0.5,
    gamma 2, alpha 5, beta 0.4, h'=4). ``head_dim=None`` means "the model's head_dim".
    ``heads``, ``head_dim``, ``rope`` and ``mode`` shape the attention kind only; ``hidden``
    the mlp kind only.
    """

    def validate(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in GATES:
            raise self._bad("kind", f"must be one of {', '.join(GATES)}")
        super().validate()
        if self.mode != "causal" and gate_class(self.kind).local:
            # a local gate reads one token: there is no gate attention to make bidirectional
            raise self._bad("mode", f"only a kind with its own attention attends; kind "
                                    f"{self.kind!r} needs 'causal'")
