"""Policy names -> classes, written out by hand (no decorator magic), plus option checking.

The learned Attention-Gate policy lives in ``kvgate.policies.attention_gate`` (written
separately); it is imported lazily, only when asked for and only if the module exists, so the
heuristic policies work without it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import fields, is_dataclass
from typing import Any

from kvgate.policies.adakv import AdaKV
from kvgate.policies.ahakv import AhaKV
from kvgate.policies.base import Policy, PolicyError
from kvgate.policies.full import Full
from kvgate.policies.h2o import H2O
from kvgate.policies.nacl import NaCl
from kvgate.policies.pyramidkv import PyramidKV
from kvgate.policies.random_keep import RandomKeep
from kvgate.policies.roco import RoCo
from kvgate.policies.snapkv import SnapKV
from kvgate.policies.streaming import Streaming
from kvgate.policies.tova import TOVA
from kvgate.policies.window import Window

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
}

# name -> module that defines a Policy subclass whose ``name`` is that name
LAZY: dict[str, str] = {"attention_gate": "kvgate.policies.attention_gate"}


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def list_policies() -> list[str]:
    """Every policy name that ``get_policy`` accepts right now."""
    return list(POLICIES) + [name for name, mod in LAZY.items() if _module_exists(mod)]


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name`` (case-insensitive); PolicyError if unknown."""
    key = str(name).strip().lower()
    if key in POLICIES:
        return POLICIES[key]
    if key in LAZY and _module_exists(LAZY[key]):
        module = importlib.import_module(LAZY[key])
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Policy) and obj.name == key:
                return obj
        raise PolicyError(f"module {LAZY[key]} defines no Policy subclass named {key!r}")
    raise PolicyError(f"unknown policy {name!r}; known: {', '.join(list_policies())}")


def policy_options(cls: type[Policy]) -> list[str]:
    """Option names a policy class accepts (its dataclass init fields)."""
    return [f.name for f in fields(cls) if f.init] if is_dataclass(cls) else []


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

    return {"policy": policy.name,
            "options": {key: plain(getattr(policy, key)) for key in policy_options(type(policy))}}


def get_policy(name: str, **options: Any) -> Policy:
    """Build a policy by name with validated options (unknown option -> PolicyError)."""
    cls = policy_class(name)
    known = policy_options(cls)
    unknown = [key for key in options if key not in known]
    if unknown:
        accepted = ", ".join(known) if known else "none"
        raise PolicyError(f"policy {cls.name!r} has no option {unknown[0]!r}; "
                          f"its options: {accepted}")
    return cls(**options)
