"""A ``--checkpoint`` / ``load_gated`` argument as a local folder: itself when it exists, else
a Hugging Face hub repository's snapshot (a published KVzap checkpoint such as
``nvidia/KVzap-mlp-Qwen3-8B``, or a gated export someone uploaded), fetched once into the hub
cache. Without a network the cached snapshot is used; with neither, one line says so."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvgate.checkpoint.format import CheckpointError
from kvgate.hub import hub_offline_reason

# ORG/NAME, as the hub spells repository ids; a local path that exists is never fetched
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what either format needs: KVzap's config and weights, a gated export's config, gates,
# adapter and tokenizer (a merged base is left to --merge users' own copies)
_PATTERNS = ["config.json", "*.safetensors", "kvgate_config.json", "adapter/*", "tokenizer/*"]


def is_repo_id(value: str) -> bool:
    return bool(_REPO_ID.match(value)) and not value.endswith((".ckpt", ".json"))


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """``path`` when it exists locally (or is no hub id); else the hub snapshot's folder.
    ``CheckpointError`` in one line when it is neither here nor to be had."""
    local = Path(path).expanduser()
    if local.exists() or not is_repo_id(str(path)):
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    reason = hub_offline_reason()
    try:
        return Path(snapshot_download(str(path), allow_patterns=_PATTERNS,
                                      local_files_only=reason is not None))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint folder here, and the hub cannot be "
                              f"reached to fetch it ({reason}) nor holds it in its cache"
                              ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: no such checkpoint folder here, and the hub gave "
                              f"none ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                              ) from None
