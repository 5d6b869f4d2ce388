"""The labels' folder: ``manifest.json`` and ``shard-NNNNN.safetensors``, written so that a
killed run leaves nothing half-written and a resumed run ends with what an unbroken one writes.

Each shard holds ``log_scores`` ``[k, L, H_kv, context]`` fp16 (log of the KVzip score,
clamped at ``LOG_FLOOR``) for blocks ``start .. start + k`` of the training set. A shard goes
to a temporary file in the folder, is synced, then renamed over its name; only then does the
manifest (rewritten the same way, ``kvgate.data.cache.write_json_atomic``) count it as done.
A kill between the two leaves a whole shard the manifest does not count: the resumed run
computes it again (the same values: one block per forward, in order) and renames over it.
Temporaries of a killed run are removed when a run begins. One writer per folder.
Only safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvgate.data.cache import read_json, write_atomic, write_json_atomic
from kvgate.data.oracle.settings import OracleError, OracleLabels

FORMAT = "kvgate-oracle-labels"
VERSION = 1
MANIFEST = "manifest.json"
KEY = "log_scores"
LOG_FLOOR = -60.0  # log of a score too small to tell from 0 (fp16 holds it; exp is ~1e-26)
# what two label sets must share to be one (the manifest's corpus and shape follow from them)
IDENTITY = ("base", "kvzip", "layout")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class LabelStore:
    """One labels folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def manifest(self) -> dict[str, Any] | None:
        meta = read_json(self.manifest_path)
        if meta is None:
            return None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise OracleError(f"{self.manifest_path}: not an oracle labels manifest")
        if meta.get("version") != VERSION:
            raise OracleError(f"{self.manifest_path}: labels format version "
                              f"{meta.get('version')!r}; this kvgate reads {VERSION}")
        return meta

    def begin(self, identity: dict[str, Any]) -> int:
        """Open the folder for writing labels of ``identity`` (``base``, ``kvzip``, ``layout``,
        plus the informative ``corpus`` and ``shape``): a new manifest, or the one a run before
        left, if it is of the same labels. Returns the blocks already done."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(".*.tmp"):  # a killed run's temporaries
            stale.unlink(missing_ok=True)
        meta = self.manifest()
        if meta is None:
            meta = {"format": FORMAT, "version": VERSION, **identity, "dtype": "float16",
                    "value": "log KVzip score", "log_floor": LOG_FLOOR, "shards": [], "done": 0}
            write_json_atomic(self.manifest_path, meta)
            return 0
        for key in IDENTITY:
            found, wanted = meta.get(key), identity[key]
            if key == "base":  # one base may be named two ways: its weights decide
                found, wanted = (found or {}).get("fingerprint"), wanted["fingerprint"]
            if found != wanted:
                raise OracleError(f"{self.path}: holds labels of {_differs(key, meta.get(key), identity[key])}; "
                                  "write these to another folder (or delete that one)")
        return int(meta["done"])

    def write_shard(self, start: int, log_scores: Tensor) -> None:
        """Blocks ``start ..`` done: their shard on disk, then counted by the manifest."""
        from safetensors.torch import save_file

        meta = self.manifest()
        if meta is None or int(meta["done"]) != start:
            raise OracleError(f"{self.path}: a shard must start at block {meta and meta['done']}"
                              f", not {start}")
        index = len(meta["shards"])
        name = shard_name(index)
        labels = log_scores.to(torch.float16).contiguous()
        write_atomic(self.path / name, lambda tmp: save_file({KEY: labels}, tmp))
        stop = start + int(log_scores.shape[0])
        meta["shards"].append({"file": name, "start": start, "stop": stop})
        meta["done"] = stop
        write_json_atomic(self.manifest_path, meta)

    def read(self) -> Tensor:
        """Every block's labels ``[done, L, H_kv, context]`` fp16, shard after shard."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        meta = self.manifest()
        parts = []
        for shard in (meta or {}).get("shards", []):  # a loop over shards
            try:
                parts.append(load_file(self.path / shard["file"])[KEY])
            except (OSError, SafetensorError, KeyError) as err:
                raise OracleError(f"{self.path / shard['file']}: unreadable labels shard "
                                  f"({type(err).__name__}); compute the labels again") from None
        if not parts:
            raise OracleError(f"{self.path}: holds no labels yet")
        return torch.cat(parts)


def _differs(key: str, found: Any, wanted: Any) -> str:
    """``another base (fingerprint X, this one Y)`` and the like, for one identity key."""
    if key == "base":
        return (f"another base ({(found or {}).get('id')!r}, fingerprint "
                f"{(found or {}).get('fingerprint')}; this base {wanted.get('id')!r} has "
                f"{wanted.get('fingerprint')})")
    if key == "kvzip":
        return f"another KVzip ({found}; these settings ask for {wanted})"
    keys = [k for k in wanted if (found or {}).get(k) != wanted[k]]
    return (f"another block layout ({', '.join(f'{k} {(found or {}).get(k)} vs {wanted[k]}' for k in keys)}"
            "; the data settings changed)")


def load_labels(settings: OracleLabels, fingerprint: str, layout: dict[str, Any],
                config: str = "...") -> Tensor:
    """The labels of ``settings.path`` for training: refused unless they were computed on the
    base of ``fingerprint`` (``base_fingerprint``), with ``settings``' KVzip, over blocks of
    ``layout`` (``block_layout``), all of them. ``config`` names the run's config in the
    advice. Returns ``[N, L, H_kv, context]`` fp16 log scores."""
    store = LabelStore(settings.path)
    meta = store.manifest()
    advice = f"kvgate data oracle --config {config}"
    if meta is None:
        raise OracleError(f"{store.path}: no oracle labels (compute them first: {advice})")
    found = meta.get("base", {})
    if found.get("fingerprint") != fingerprint:
        raise OracleError(f"{store.path}: labels of another base ({found.get('id')!r}, "
                          f"fingerprint {found.get('fingerprint')}); this run's base has "
                          f"{fingerprint}: compute its own ({advice})")
    if meta.get("kvzip") != settings.kvzip():
        raise OracleError(f"{store.path}: {_differs('kvzip', meta.get('kvzip'), settings.kvzip())}")
    if meta.get("layout") != layout:
        raise OracleError(f"{store.path}: labels of {_differs('layout', meta.get('layout'), layout)}")
    if int(meta["done"]) != layout["blocks"]:
        raise OracleError(f"{store.path}: labels cover {meta['done']} of {layout['blocks']} "
                          f"blocks; finish them ({advice})")
    labels = store.read()
    if labels.shape[0] != layout["blocks"] or labels.shape[-1] != layout["context"]:
        raise OracleError(f"{store.path}: shards hold {tuple(labels.shape)}, the manifest "
                          f"{layout['blocks']} blocks of {layout['context']} tokens")
    return labels
