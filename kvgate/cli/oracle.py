"""``kvgate data oracle --config NAME``: the oracle labels of a training config's blocks.

The config is the training run's own (``kvgate train --config NAME`` reads the same file): the
base (``model.base_model``, ``model.dtype``), the blocks (the ``data`` module, a
``CPTDataModule``) and where the labels go with which KVzip (``data.init_args.oracle``). Run it
again after a kill: it continues. ``--devices N`` (and ``--num-nodes``) label data-parallel:
Lightning's DDP launches N processes, each labels its share of the blocks into the same folder
(``kvgate.data.oracle.compute``); on the CPU they talk through gloo. Progress (blocks done of
all, time left) goes to stderr, a bar on a terminal and a line a shard elsewhere; ``--quiet``
leaves it out.
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


def trainer_for(device: str, devices: int, num_nodes: int) -> Any:
    """The labelling Trainer for ``--device`` (``cpu``, ``cuda`` or ``cuda:K``), ``--devices``
    and ``--num-nodes``; a count below 1 is one line."""
    from kvgate.data.oracle.compute import labelling_trainer
    from kvgate.models.load import check_device

    for flag, value in (("--devices", devices), ("--num-nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OracleError(f"{flag}: must be an integer >= 1 (got {value!r})")
    check_device(device)
    accelerator, _, index = str(device).partition(":")
    if index and devices > 1:
        raise OracleError(f"--device {device} names one GPU; give --device cuda with --devices "
                          f"{devices}")
    return labelling_trainer(accelerator, [int(index)] if index else devices, num_nodes)


def run(config_arg: str, device: str = "cpu", devices: int = 1, num_nodes: int = 1,
        quiet: bool = False) -> int:
    import yaml

    from kvgate.cli.train import check_config_files, resolve_config_args
    from kvgate.files import check_output_dir
    from kvgate.models import load_base

    trainer = trainer_for(device, devices, num_nodes)  # bad counts fail before anything is read
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
    from kvgate.data.oracle.compute import label_data
    from kvgate.progress import silenced

    with silenced(quiet):  # a first load's GGUF conversion too
        # loaded on the CPU: the Trainer moves it to each process's device
        model, tokenizer = load_base(base, dtype=model_cfg.get("dtype", "float32"))

    label_data(model, tokenizer, data, str(base), partial(print, flush=True), trainer, quiet)
    return 0
