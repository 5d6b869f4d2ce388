"""The names of the gated-checkpoint format and its one error, shared by writing and reading."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.errors import KVGateError

FORMAT = "kvgate-gated"
FORMAT_VERSION = 1
CONFIG_NAME = "kvgate_config.json"
GATES_NAME = "gates.safetensors"
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(KVGateError, RuntimeError):
    """A gated checkpoint is missing, damaged, of an unknown version, or does not fit the base
    model it is loaded onto; the message names the file or field."""


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or no object (what
    telling a folder's format needs; reading one then says what is wrong with it)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_gated_export(folder: Path) -> bool:
    """Whether ``folder`` holds a gated export: a ``kvgate_config.json`` of this format (its
    files are not checked; a damaged export is still one)."""
    meta = read_json_object(folder / CONFIG_NAME)
    return meta is not None and meta.get("format") == FORMAT
