"""The labels' folder: ``manifest.json`` and ``shard-NNNNN.safetensors``, written so that a
killed run leaves nothing half-written, a resumed run ends with what an unbroken one writes,
and several processes (``kvgate data oracle --devices N``) fill one folder side by side.

Shard ``i`` holds ``log_scores`` ``[k, L, H_kv, context]`` fp16 (log of the KVzip score,
clamped at ``LOG_FLOOR``) for blocks ``i * k .. (i + 1) * k`` of the training set, ``k`` the
folder's ``shard_blocks``. A shard goes to a temporary file in the folder, is synced, then
renamed over its name; only then does its writer record it, with its size and sha256, in its
own ``progress-rank-R.json`` (rewritten atomically, ``kvgate.data.cache.write_json_atomic``):
two processes never write the same file. ``merge`` folds the progress files into the
manifest (rank 0, at the start and at the end of a run); a kill between a shard and its record
leaves a whole shard nobody counts, which the resumed run computes again (the same values: one
block per forward, in order) and renames over it.

Every listed shard is checked against its size and sha256 when a run begins (a damaged or
replaced shard is named and computed again) and when training reads the labels (refused with
the command that mends them). A shard with a non-finite value is never written. Folders of the
first format (no sizes or hashes) are adopted when a run begins, shard by shard, after a check
that each is whole and finite. Only safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvgate.data.cache import read_json, write_atomic, write_json_atomic
from kvgate.data.oracle.settings import OracleError, OracleLabels
from kvgate.files import sha256_file

FORMAT = "kvgate-oracle-labels"
VERSION = 2
MANIFEST = "manifest.json"
KEY = "log_scores"
LOG_FLOOR = -60.0  # log of a score too small to tell from 0 (fp16 holds it; exp is ~1e-26)
# what two label sets must share to be one (the manifest's corpus and shape follow from them)
IDENTITY = ("base", "kvzip", "layout")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def progress_name(rank: int) -> str:
    return f"progress-rank-{rank:05d}.json"


PROGRESS_GLOB = "progress-rank-*.json"


def _shard_tensor(path: Path) -> Tensor:
    """The labels of one shard file; ``OracleError`` naming it when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)[KEY]
    except (OSError, SafetensorError, KeyError) as err:
        raise OracleError(f"{path}: unreadable labels shard ({type(err).__name__})") from None


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
        if meta.get("version") not in (1, VERSION):
            raise OracleError(f"{self.manifest_path}: labels format version "
                              f"{meta.get('version')!r}; this kvgate reads 1 and {VERSION}")
        return meta

    # ------------------------------------------------------------------ writing (a run)
    def begin(self, identity: dict[str, Any], shard_blocks: int,
              say: Callable[[str], None] = print) -> dict[str, Any]:
        """Open the folder for labels of ``identity`` (``base``, ``kvzip``, ``layout``, plus
        the informative ``corpus`` and ``shape``): a new manifest, or the one a run before left
        if it is of the same labels, with its verified shards and the records a killed run left
        merged in. A damaged shard is named through ``say`` and dropped (computed again). One
        process calls it (rank 0), before any writes. Returns the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(".*.tmp"):  # a killed run's temporaries
            stale.unlink(missing_ok=True)
        meta = self.manifest()
        if meta is None:
            meta = {"format": FORMAT, "version": VERSION, **identity, "dtype": "float16",
                    "value": "log KVzip score", "log_floor": LOG_FLOOR,
                    "shard_blocks": shard_blocks, "shards": [], "done": 0}
            for stale in self.path.glob(PROGRESS_GLOB):
                stale.unlink()  # records of a folder whose manifest is gone count for nothing
            write_json_atomic(self.manifest_path, meta)
            return meta
        for key in IDENTITY:
            found, wanted = meta.get(key), identity[key]
            if key == "base":  # one base may be named two ways: its weights decide
                found, wanted = (found or {}).get("fingerprint"), wanted["fingerprint"]
            if found != wanted:
                raise OracleError(f"{self.path}: holds labels of {_differs(key, meta.get(key), identity[key])}; "
                                  "write these to another folder (or delete that one)")
        if meta.get("version") == 1:
            meta = self._adopt_first_format(meta, shard_blocks, say)
        return self.merge(say)

    def _adopt_first_format(self, meta: dict[str, Any], shard_blocks: int,
                            say: Callable[[str], None]) -> dict[str, Any]:
        """A folder of format 1 (shards written in order, no sizes or hashes) as format 2: each
        shard that reads back whole, with the manifest's shape and finite values, is kept."""
        kept = []
        for shard in meta.get("shards", []):
            record = {**shard, "bytes": None, "sha256": None}
            why = self._shard_fault(record, meta, check_hash=False)
            if why:
                say(f"{self.path / shard['file']}: {why}; computing it again")
                break  # format 1 counted a prefix: what follows a bad shard is recomputed too
            file = self.path / shard["file"]
            kept.append({**shard, "bytes": file.stat().st_size, "sha256": sha256_file(file)})
        first = kept[0]["stop"] - kept[0]["start"] if kept else shard_blocks
        meta.update(version=VERSION, shard_blocks=first, shards=kept,
                    done=sum(s["stop"] - s["start"] for s in kept))
        write_json_atomic(self.manifest_path, meta)
        say(f"{self.path}: adopted {len(kept)} shard(s) of the first labels format")
        return meta

    def write_shard(self, index: int, log_scores: Tensor, rank: int = 0) -> dict[str, Any]:
        """Shard ``index`` (blocks ``index * k ..``) on disk, then recorded in this rank's
        progress file. Non-finite labels are refused, naming the block."""
        from safetensors.torch import save_file

        meta = self.manifest()
        k = int(meta["shard_blocks"])
        start = index * k
        finite = torch.isfinite(log_scores).flatten(1).all(1)
        if not bool(finite.all()):
            block = start + int((~finite).nonzero()[0])
            raise OracleError(f"block {block}: the base's KVzip scores are not finite (NaN or "
                              "inf); check model.dtype (float16 overflows) and the base's weights")
        name = shard_name(index)
        labels = log_scores.to(torch.float16).contiguous()
        write_atomic(self.path / name, lambda tmp: save_file({KEY: labels}, tmp))
        record = {"file": name, "start": start, "stop": start + int(log_scores.shape[0]),
                  "bytes": (self.path / name).stat().st_size,
                  "sha256": sha256_file(self.path / name)}
        progress = self.path / progress_name(rank)
        done = (read_json(progress) or {}).get("shards", [])
        write_json_atomic(progress, {"shards": [*done, record]})
        return record

    def recorded_blocks(self) -> int:
        """Blocks the progress files record: the shards every rank finished since the last
        ``merge`` (what rank 0's progress display counts while the ranks write)."""
        return sum(int(r["stop"]) - int(r["start"]) for file in self.path.glob(PROGRESS_GLOB)
                   for r in (read_json(file) or {}).get("shards", []))

    def merge(self, say: Callable[[str], None] = print) -> dict[str, Any]:
        """The manifest with every progress file's records folded in, then those files removed;
        each shard listed is verified (size, sha256) and a damaged one dropped, named through
        ``say``. One process calls it (rank 0), while no one writes."""
        meta = self.manifest()
        records = {s["file"]: s for s in meta["shards"]}
        progress = sorted(self.path.glob(PROGRESS_GLOB))
        for file in progress:  # later records of a file replace earlier ones
            for record in (read_json(file) or {}).get("shards", []):
                records[record["file"]] = record
        kept = []
        for record in sorted(records.values(), key=lambda r: r["start"]):
            why = self._shard_fault(record, meta)
            if why:
                say(f"{self.path / record['file']} (blocks {record['start']}-"
                    f"{record['stop'] - 1}): {why}; computing it again")
                (self.path / record["file"]).unlink(missing_ok=True)
            else:
                kept.append(record)
        meta.update(shards=kept, done=sum(s["stop"] - s["start"] for s in kept))
        write_json_atomic(self.manifest_path, meta)
        for file in progress:
            file.unlink(missing_ok=True)
        return meta

    def _shard_fault(self, record: dict[str, Any], meta: dict[str, Any],
                     check_hash: bool = True) -> str | None:
        """Why a recorded shard cannot be used (missing, another size or hash, unreadable, not
        the recorded shape, non-finite), or None. With ``check_hash`` the file's bytes decide
        alone (they were finite when written); without, the values are read and checked."""
        file = self.path / record["file"]
        if not file.is_file():
            return "missing"
        if check_hash:
            size = file.stat().st_size
            if size != record.get("bytes"):
                return f"damaged ({size} bytes, the record says {record.get('bytes')})"
            if sha256_file(file) != record.get("sha256"):
                return "damaged (its sha256 differs from the record)"
            return None
        try:
            labels = _shard_tensor(file)
        except OracleError:
            return "unreadable"
        layout, shape = meta["layout"], meta.get("shape", {})
        want = (record["stop"] - record["start"], shape.get("layers"), shape.get("kv_heads"),
                layout["context"])
        if tuple(labels.shape) != want:
            return f"holds {tuple(labels.shape)}, not {want}"
        if not bool(torch.isfinite(labels).all()):
            return "holds non-finite values"
        return None

    def pending(self, total: int) -> list[int]:
        """Indices of the shards of ``total`` blocks that the manifest does not hold."""
        meta = self.manifest()
        k = int(meta["shard_blocks"])
        have = {s["start"] // k for s in meta["shards"]}
        return [i for i in range(-(-total // k)) if i not in have]

    # ------------------------------------------------------------------ reading (training)
    def read(self, advice: str = "compute the labels again") -> Tensor:
        """Every listed block's labels ``[done, L, H_kv, context]`` fp16, in block order, each
        shard checked against its recorded size and sha256 (a first-format folder, which has
        neither, for being whole and finite) first. ``advice`` ends a refusal."""
        meta = self.manifest()
        parts = []
        for record in sorted((meta or {}).get("shards", []), key=lambda r: r["start"]):
            why = self._shard_fault(record, meta, check_hash=meta.get("version") != 1)
            if why:
                raise OracleError(f"{self.path / record['file']}: {why}; {advice}")
            parts.append(_shard_tensor(self.path / record["file"]))
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
                config: str = "CONFIG") -> Tensor:
    """The labels of ``settings.path`` for training: refused unless they were computed on the
    base of ``fingerprint`` (``base_fingerprint``), with ``settings``' KVzip, over blocks of
    ``layout`` (``block_layout``), all of them, each shard whole. ``config`` names the run's
    config in the advice. Returns ``[N, L, H_kv, context]`` fp16 log scores."""
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
    labels = store.read(f"run {advice} (it computes damaged shards again)")
    if labels.shape[0] != layout["blocks"] or labels.shape[-1] != layout["context"]:
        raise OracleError(f"{store.path}: shards hold {tuple(labels.shape)}, the manifest "
                          f"{layout['blocks']} blocks of {layout['context']} tokens")
    return labels
