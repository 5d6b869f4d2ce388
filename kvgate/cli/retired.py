"""Training settings kvgate no longer has, as a saved config or an old command still gives them.

A config written before a switch was removed (a recipe, or the ``config.yaml`` a run saved
beside its logs) still loads when it asks for nothing the switch did: ``warmstart_steps: 0``
and its two companions, and the gate's ``previous_layer: false``, are dropped before the parser
sees them. One that asks for the removed
behaviour (``warmstart_steps: 30``, ``kernel: flex``) stops with one line naming the key and
what replaced it, instead of the parser's "unexpected key" or a list of the kernels there are.
The same holds for the flags (``--model.recipe.warmstart_steps 30``, ``--model.gate.kernel=flex``)
and for a mapping given to a flag above them (``--model.recipe '{...}'``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate.attention.kernels import RETIRED_KERNELS
from kvgate.errors import KVGateError
from kvgate.gate.config import RETIRED as RETIRED_GATE
from kvgate.gate.config import retired_inert
from kvgate.recipes.settings import RETIRED as RETIRED_RECIPE

__all__ = ["RETIRED", "Retired", "RetiredSettingError", "retire_settings"]


class RetiredSettingError(KVGateError, ValueError):
    """A config or flag asks for a removed setting's behaviour; the message names the key and
    what replaced it."""


@dataclass(frozen=True)
class Retired:
    """One removed setting: where it sits in a training config, which values ask for nothing
    removed (``inert``), whether the key itself is gone (dropped when inert) or only some of its
    values are (kept when inert), and what replaced it."""

    path: tuple[str, ...]
    inert: Callable[[Any], bool]
    gone: bool
    why: Callable[[Any], str]


def _warm_start_off(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and value == 0)


def _recipe(key: str, inert: Callable[[Any], bool]) -> Retired:
    return Retired(("model", "recipe", key), inert, True, lambda value: RETIRED_RECIPE[key])


RETIRED: tuple[Retired, ...] = (
    _recipe("warmstart_steps", _warm_start_off),
    # they did nothing without warmstart_steps (checked above): inert whatever their value
    _recipe("warmstart_policy", lambda value: True),
    _recipe("warmstart_keep", lambda value: True),
    Retired(("model", "gate", "kernel"), lambda value: value not in RETIRED_KERNELS, False,
            lambda value: f"{value!r}: {RETIRED_KERNELS[value]}"),
    Retired(("model", "gate", "previous_layer"), retired_inert, True,
            lambda value: RETIRED_GATE["previous_layer"]),
)


def _cleaned(value: Any, at: tuple[str, ...], source: str = "") -> tuple[Any, bool]:
    """``value`` (found at config path ``at``) with every inert retired key under it dropped,
    and whether anything was (``None, True``: the value is a retired key's own, dropped);
    ``RetiredSettingError`` for one that is not inert, naming the key and ``source``."""
    changed = False
    for retired in RETIRED:
        if retired.path[: len(at)] != at:
            continue
        rest, parent, node = retired.path[len(at):], None, value
        for key in rest:
            if not isinstance(node, dict) or key not in node:
                break
            parent, node = node, node[key]
        else:
            if not retired.inert(node):
                raise RetiredSettingError(
                    f"{'.'.join(retired.path)}: {retired.why(node)}{source}")
            if retired.gone and parent is None:
                return None, True
            if retired.gone:
                del parent[rest[-1]]
                changed = True
    return value, changed


def _config(value: str) -> str:
    """A ``--config`` value with its inert retired keys dropped: the value itself when it has
    none, else its cleaned mapping as inline YAML (which the parser takes too)."""
    try:
        text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
        tree = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return value  # check_config_files reports it
    if not isinstance(tree, dict):
        return value
    tree, changed = _cleaned(tree, (), f" (--config {value})" if len(value) < 200 else "")
    return yaml.safe_dump(tree, sort_keys=False) if changed else value


def _flag_path(arg: str) -> tuple[str, ...] | None:
    """The config path of a ``--a.b.c`` flag when a retired setting sits at or under it."""
    if not arg.startswith("--"):
        return None
    path = tuple(arg[2:].split("=", 1)[0].split("."))
    return path if any(r.path[: len(path)] == path for r in RETIRED) else None


def retire_settings(argv: list[str]) -> list[str]:
    """``argv`` (after ``resolve_config_args``) with the inert retired settings of its configs
    and flags dropped; ``RetiredSettingError`` for one that asks for a removed behaviour."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c") and i + 1 < len(argv):
            out += [arg, _config(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            out.append("--config=" + _config(arg.split("=", 1)[1]))
            i += 1
            continue
        path = _flag_path(arg)
        inline = "=" in arg
        if path is None or (not inline and i + 1 == len(argv)):
            out.append(arg)  # not ours, or a flag without its value: the parser says so
            i += 1
            continue
        raw = arg.split("=", 1)[1] if inline else argv[i + 1]
        i += 1 if inline else 2
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        cleaned, changed = _cleaned(value, path)
        if not changed:
            out += [arg] if inline else [arg, raw]
        elif cleaned is not None:  # a mapping above the retired keys, without them
            out += ["--" + ".".join(path), json.dumps(cleaned)]
    return out
