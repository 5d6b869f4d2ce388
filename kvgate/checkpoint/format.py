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


def is_gated_export(folder: Path) -> bool:
    """Whether ``folder`` holds a gated export: a ``kvgate_config.json`` of this format (its
    files are not checked; a damaged export is still one)."""
    try:
        with open(folder / CONFIG_NAME, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT
