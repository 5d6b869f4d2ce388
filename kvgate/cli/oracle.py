"""``kvgate data oracle --config NAME``: the oracle labels of a training config's blocks.

The config is the training run's own (``kvgate train --config NAME`` reads the same file): the
base (``model.base_model``, ``model.dtype``), the blocks (the ``data`` module, a
``CPTDataModule``) and where the labels go with which KVzip (``data.init_args.oracle``). Run it
again after a kill: it continues.
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any

from kvgate.data.oracle.settings import OracleError


def data_module(config: dict[str, Any]) -> Any:
    """The config's CPT data module, built from its ``class_path`` and ``init_args``."""
    from kvgate.training.data import CPTDataModule

    data = config.get("data")
    path = data.get("class_path") if isinstance(data, dict) else None
    if not isinstance(path, str) or "." not in path:
        raise OracleError("data.class_path: the config names no data module")
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        raise OracleError(f"data.class_path: {path!r} cannot be imported") from None
    if not (isinstance(cls, type) and issubclass(cls, CPTDataModule)):
        raise OracleError(f"data.class_path: oracle labels are for packed CPT blocks "
                          f"(CPTDataModule), not {path}")
    return cls(**(data.get("init_args") or {}))


def run(config_arg: str, device: str = "cpu") -> int:
    import yaml

    from kvgate.cli.train import check_config_files, resolve_config_args
    from kvgate.files import check_output_dir
    from kvgate.models import load_base

    argv = resolve_config_args(["--config", config_arg])
    check_config_files(argv)
    with open(argv[1], encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    data = data_module(config)
    if data.oracle is None:
        raise OracleError("data.init_args.oracle: not set; name the labels' folder (path) and "
                          "their KVzip (plus, chunk, sinks)")
    check_output_dir(data.oracle.path, "data.init_args.oracle.path")
    model_cfg = config.get("model") or {}
    base = model_cfg.get("base_model", "smollm2-135m")
    model, tokenizer = load_base(base, dtype=model_cfg.get("dtype", "float32"), device=device)
    from kvgate.data.oracle.compute import label_data

    label_data(model, tokenizer, data, str(base), partial(print, flush=True))
    return 0
