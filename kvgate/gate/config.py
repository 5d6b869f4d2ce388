"""Typed, validated configuration of the learned gates: ``GateConfig``, the settings every kind
shares (:mod:`kvgate.gate.settings`) beside each registered kind's own (``kvgate.gate.kinds``:
``AttentionSettings``, ``MLPSettings``, ...), in the one flat form that run configs
(``model.gate: {kind: mlp, hidden: 512, tau: 0.5, ...}``), ``--model.gate.KEY`` flags, Lightning
hyper-parameters and exports (``kvgate_config.json``'s "gate") write.

The flat form of a kind: the shared fields and the kind's own. A field of another kind is
accepted and ignored while it holds its default (configs and exports written before the kinds
had settings of their own list every field); any other value of it is refused in one line
naming the field and the kind, since that kind would not read it. One exception keeps old
configs loading: ``head_dim`` is ignored on a kind that does not read it whatever its value
(``configs/cpt_kvzap.yaml``, kind mlp, copied the attention recipe's ``head_dim: 32``, and every
export trained from it records it).

Removed settings (``RETIRED``, issue #62) may still sit in a saved config or an export: one that
asks for nothing the setting did (``previous_layer: false``) loads without it (``from_dict``
here; ``kvgate.cli.retired`` for a run config), one that asks for it is refused in one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvgate.gate.attention import GateMode
from kvgate.gate.kinds import GATE_KINDS, GATES, gate_class
from kvgate.gate.settings import (
    ConfigError,
    GateKernel,
    GateKind,
    GatePrefill,
    GateSettings,
    GateTarget,
    KindSettings,
    read_settings,
)

__all__ = ["GATE_KINDS", "RETIRED", "ConfigError", "GateConfig", "GateKernel", "GateKind",
           "GateMode", "GatePrefill", "GateTarget", "retired_inert"]

# removed gate settings and why; each asked for nothing while false (or null)
RETIRED: dict[str, str] = {
    "previous_layer": "gating layer l from layer l-1's input was an ablation of the "
                      "Attention-Gate paper, removed with no replacement; leave the key out",
}


def retired_inert(value: Any) -> bool:
    """Whether a removed setting's value asks for nothing it did (false or null)."""
    return value is None or value is False

# every registered kind's own settings class, once each (a kind without settings of its own
# has KindSettings, which adds no field); the bases go in reverse so the fields follow the
# registry's order
_KIND_SETTINGS = tuple(dict.fromkeys(cls.settings_class for cls in GATES.values()
                                     if cls.settings_class is not KindSettings))
_SHARED = tuple(f.name for f in fields(GateSettings))
# fields another kind's config may carry at any value, ignored there (see the module docstring)
IGNORED_ELSEWHERE = frozenset({"head_dim"})


def _owners() -> dict[str, list[str]]:
    """Field name -> the registered kinds that read it. Two kinds may share a field only with
    one default (the flat form has one), and none may reuse a shared field's name."""
    owners: dict[str, list[str]] = {}
    defaults: dict[str, Any] = {}
    for kind, cls in GATES.items():
        for f in fields(cls.settings_class):
            if f.name in _SHARED or defaults.get(f.name, f.default) != f.default:
                raise TypeError(f"gate kind {kind!r}: setting {f.name!r} clashes with another "
                                "kind's or a shared one (kvgate.gate.config)")
            defaults[f.name] = f.default
            owners.setdefault(f.name, []).append(kind)
    return owners


_OWNERS = _owners()


@dataclass
class GateConfig(*reversed(_KIND_SETTINGS), GateSettings):
    """Gate hyper-parameters: ``kind`` picks the gate's architecture among the registered
    kinds; the shared fields are :class:`GateSettings`'; every kind's own fields follow, of
    which a gate reads only its kind's (``kind_settings()``). Defaults follow the
    Attention-Gate paper's continual pre-training setting (tau 0.5, gamma 2, alpha 5, beta
    0.4, h'=4). The module docstring says which fields of other kinds are accepted."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in GATES:
            raise self._bad("kind", f"must be one of {', '.join(GATES)}")
        GateSettings.validate(self)
        own = {f.name for f in fields(gate_class(self.kind).settings_class)}
        for name, kinds in _OWNERS.items():
            if name in own:
                continue
            default = self.__dataclass_fields__[name].default
            value = getattr(self, name)
            if type(value) is type(default) and value == default:
                continue
            if name in IGNORED_ELSEWHERE:
                setattr(self, name, default)
                continue
            raise self._bad(name, f"kind {self.kind!r} does not read it (a setting of kind "
                                  f"{' / '.join(kinds)}); leave it out")
        self.kind_settings()  # checks the kind's own fields

    def kind_settings(self) -> KindSettings:
        """The settings of this config's kind alone (``AttentionSettings`` for attention, ...),
        checked; what a gate of the kind reads as ``gate.settings``."""
        return read_settings(gate_class(self.kind).settings_class, self)

    def to_dict(self) -> dict[str, Any]:
        """The flat form of this kind: the shared fields and the kind's own."""
        own = {f.name for f in fields(gate_class(self.kind).settings_class)}
        return {k: v for k, v in asdict(self).items() if k in _SHARED or k in own}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateConfig:
        """A config from its flat form (an export's "gate", a checkpoint's hyper-parameters);
        a removed setting's key is dropped while it asks for nothing (``RETIRED``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(RETIRED))
        if unknown:
            raise ConfigError(f"GateConfig: unknown key(s) {unknown}; known: {sorted(known)}")
        for key in sorted(set(RETIRED) & set(data)):
            if not retired_inert(data[key]):
                raise ConfigError(f"GateConfig.{key}: {RETIRED[key]} (got {data[key]!r})")
        return cls(**{key: value for key, value in data.items() if key in known})
