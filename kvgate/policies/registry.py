"""Policy names -> classes, written out by hand (no decorator magic), plus option checking.

Adding a policy to kvgate: one file defining a ``Policy`` subclass, one line in ``POLICIES``,
one test. Code outside the package (a research policy, e.g. ``experiments/policies/``) adds
one with ``register_policy(name, cls)`` before it builds policies by name: from then on
``get_policy``, ``list_policies`` (so ``--policies all``) and every command's ``--policies``
know it, in that process only.
"""

from __future__ import annotations

from dataclasses import Field, fields, is_dataclass
from typing import Any

from kvgate.policies.adakv import AdaKV
from kvgate.policies.ahakv import AhaKV
from kvgate.policies.attention_gate import AttentionGatePolicy
from kvgate.policies.base import Policy, PolicyError, make_policy, policy_options
from kvgate.policies.full import Full
from kvgate.policies.gate_rank import GateRank
from kvgate.policies.h2o import H2O
from kvgate.policies.knorm import KNorm
from kvgate.policies.kvzip import KVzip
from kvgate.policies.local_gate import LocalGatePolicy
from kvgate.policies.nacl import NaCl
from kvgate.policies.pyramidkv import PyramidKV
from kvgate.policies.random_keep import RandomKeep
from kvgate.policies.roco import RoCo
from kvgate.policies.snapkv import SnapKV
from kvgate.policies.streaming import Streaming
from kvgate.policies.tova import TOVA
from kvgate.policies.window import Window

__all__ = ["POLICIES", "gate_policy_name", "get_policy", "list_policies", "policy_class",
           "policy_options", "policy_spec", "register_policy"]

POLICIES: dict[str, type[Policy]] = {
    "full": Full,
    "window": Window,
    "random": RandomKeep,
    "streaming": Streaming,
    "h2o": H2O,
    "tova": TOVA,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "adakv": AdaKV,
    "nacl": NaCl,
    "roco": RoCo,
    "ahakv": AhaKV,
    "knorm": KNorm,
    "kvzip": KVzip,
    "attention_gate": AttentionGatePolicy,
    "local_gate": LocalGatePolicy,
    "gate_rank": GateRank,
}


def register_policy(name: str, cls: type[Policy]) -> None:
    """Make ``cls`` a policy named ``name`` for ``get_policy`` and every command in this
    process: the way code outside kvgate adds one (registering the same class again does
    nothing). ``name`` must be new, a lower-case identifier (``LABEL=NAME`` and
    ``NAME.option`` parse it) and the class's own ``name`` (stored results record that one);
    a ``PolicyError`` names what is wrong otherwise."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"register_policy({name!r}): {cls!r} is not a Policy subclass")
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise PolicyError(f"register_policy: the name {name!r} must be a lower-case identifier")
    if getattr(cls, "name", None) != name:
        raise PolicyError(f"register_policy({name!r}): {cls.__name__}.name is "
                          f"{getattr(cls, 'name', None)!r}; the two must agree (results store "
                          "the class's name)")
    if POLICIES.get(name, cls) is not cls:
        raise PolicyError(f"register_policy: {name!r} is taken by {POLICIES[name].__name__}")
    POLICIES[name] = cls


def list_policies() -> list[str]:
    """Every policy name that ``get_policy`` accepts."""
    return list(POLICIES)


def gate_policy_name(kind: str | None) -> str:
    """The policy that serves a gated model of ``kind`` by default: ``local_gate`` for a local
    kind (it scores and evicts while decoding too), ``attention_gate`` otherwise."""
    from kvgate.gate.kinds import GATES

    return "local_gate" if kind in GATES and GATES[kind].local else "attention_gate"


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name`` (case-insensitive); PolicyError if unknown."""
    key = str(name).strip().lower()
    if key not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[key]


def policy_spec(policy: Policy) -> dict[str, Any]:
    """What a policy is, in plain JSON values: its name and every option's value (a nested
    policy, e.g. Ada-KV's inner one, as its own spec). An evaluation stores it beside each
    labelled result, so a label reused with other options is caught, not mixed."""
    def plain(value: Any) -> Any:
        if isinstance(value, Policy):
            return policy_spec(value)
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return repr(value)

    # an option added after results were stored (``allocation``) is written only when it is
    # not at its default, so the specs stored before it still match; one whose default
    # changes what was stored (local_gate's ``interval``) is left out only at ``omit_at``,
    # the value that behaves as before it existed
    quiet = {f.name for f in fields(policy) if _quiet(f, getattr(policy, f.name))
             } if is_dataclass(policy) else set()
    return {"policy": policy.name,
            "options": {key: plain(getattr(policy, key)) for key in policy_options(type(policy))
                        if key not in quiet}}


def _quiet(option: Field, value: Any) -> bool:
    """Whether ``policy_spec`` leaves ``option`` at ``value`` out of the spec."""
    if "omit_at" in option.metadata:
        return value == option.metadata["omit_at"]
    return bool(option.metadata.get("omit_default")) and value == option.default


def get_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name with validated options (unknown option -> PolicyError)."""
    return make_policy(policy_class(name), **options)
