"""Command-line flags written from a config dataclass: each field is one flag, its help and
default stated once, where the field is declared.

``opt(default, "help")`` declares a field; :func:`add_flags` turns every field of a config
class into a flag named as the field (``max_length`` -> ``--max-length``): a ``bool`` field
becomes a switch (``--query-aware``; ``--no-chat`` when it defaults to true), an ``int`` or
``float`` one takes a number, every other one a string the config parses. No flag has an
argparse default: a flag left out stays out of the namespace, so the config's default holds.
Help is plain text: :func:`plain` drops the reST markup docstrings use.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

_ROLES = re.compile(r":(?:mod|func|class|data|attr|meth):`~?([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST markup: ``code`` and :mod:`name` become code and name."""
    return _ROLES.sub(r"\1", text or "").replace("``", "")


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None,
        **flag: Any) -> Any:
    """A config field with its flag's help; ``flag`` goes to ``add_argument`` (``choices``,
    ``metavar``, ``action``, ``nargs``, ``group``: a required one-of group by that name,
    ``required``, ``hidden``: no flag, ``also``: other spellings of the flag)."""
    meta = {"help": help, **flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(annotation: Any) -> type:
    text = str(annotation)
    if text == "bool":
        return bool
    if re.fullmatch(r"int( \| None)?", text):
        return int
    if re.fullmatch(r"float( \| None)?", text):
        return float
    return str


def _shown(value: Any) -> str | None:
    """A default as help shows it; None for none worth showing."""
    if value is None or value is dataclasses.MISSING or value == [] or isinstance(value, bool):
        return None
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass ``cls`` (see the module docstring)."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if meta.pop("hidden", False):
            continue
        text = plain(meta.pop("help", ""))
        group = meta.pop("group", None)
        also = tuple(meta.pop("also", ()))
        kind = _kind(f.type)
        name = flag_name(f.name)
        kwargs: dict[str, Any] = {"dest": f.name, **meta}
        if kind is bool:
            if f.default is True:
                name = flag_name(f"no_{f.name}")
                kwargs["action"] = "store_false"
            else:
                kwargs["action"] = "store_true"
        else:
            if kind is not str:
                kwargs["type"] = kind
            shown = _shown(f.default)
            if shown is not None:
                text = f"{text} (default {shown})" if text else f"default {shown}"
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs.setdefault("required", True)
        target: Any = parser
        if group is not None:
            if group not in groups:
                groups[group] = parser.add_mutually_exclusive_group(required=True)
            target = groups[group]
        target.add_argument(name, *also, help=text.replace("%", "%%") or None, **kwargs)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def summary(cls: type) -> str:
    """The first line of a config's docstring, as a command's one-line help."""
    return plain((cls.__doc__ or "").strip().splitlines()[0]).rstrip(".")
