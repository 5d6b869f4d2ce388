"""Export a trained ``KVGateModule`` to the gated-checkpoint format (``kvgate.checkpoint``).

``export_checkpoint(CKPT, OUT)`` (the ``kvgate export`` command) reads a Lightning checkpoint
written by ``train.py`` (gates + LoRA + optimiser state, no base weights), or a DeepSpeed
checkpoint folder (consolidated first; needs deepspeed); the base is loaded again from the id
recorded in it. OUT receives the folder described in ``kvgate.checkpoint``. ``merge`` folds
LoRA into the base weights and stores the merged base in OUT/merged (large: a full copy of the
model). ``export_module`` exports a module already in memory (the ``ExportGated`` callback).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from kvgate.checkpoint import CONFIG_NAME, CheckpointError, export_gated, is_gated_export
from kvgate.checkpoint.guards import check_finite
from kvgate.checkpoint.place import check_target
from kvgate.files import check_output_dir
from kvgate.training.integrity import (
    better_checkpoint,
    brief_error,
    verify_checkpoint,
    warn_unverified,
)
from kvgate.training.module import CKPT_KEY, KVGateModule


def export_module(module: KVGateModule, out: str | os.PathLike, merge: bool = False,
                  overwrite: bool = False, global_step: int | None = None,
                  inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Export a built ``KVGateModule`` (after or without training) to ``out``; ``inputs``: the
    files it was read from, which ``overwrite`` must never replace."""
    if module.model is None:
        raise CheckpointError("export: the module's model is not built (call configure_model())")
    training = dict(module.hparams)
    if global_step is not None:
        training["global_step"] = int(global_step)
    return export_gated(
        module.model, out, base_model=module.base_model, fingerprint=module.fingerprint,
        gate_config=module.gate_cfg if module.gated else None, training=training,
        metrics=dict(module.final_metrics), tokenizer=module.tokenizer, merge=merge,
        overwrite=overwrite, inputs=inputs)


def load_lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a Lightning checkpoint with the safe (weights-only) unpickler, after checking it
    against its sha256 sidecar (``kvgate.training.integrity``). A DeepSpeed checkpoint (a
    folder) is consolidated into one file first."""
    path = Path(path)
    if path.is_dir():
        if is_gated_export(path):
            raise CheckpointError(f"{path}: a gated export (it has {CONFIG_NAME}), not a training "
                                  "checkpoint: it is exported already; give a .ckpt file written "
                                  "by kvgate train (e.g. RUN/checkpoints/last.ckpt)")
        if not (path / "latest").is_file() and not (path / "checkpoint").is_dir():
            raise CheckpointError(f"{path}: a folder, but neither a Lightning .ckpt file nor a "
                                  "DeepSpeed checkpoint folder; give a .ckpt file written by "
                                  "kvgate train (e.g. RUN/checkpoints/last.ckpt)")
        return _load_deepspeed_checkpoint(path)
    try:
        verified = verify_checkpoint(path, warn_missing=False)  # against its sha256 sidecar
    except CheckpointError as err:
        raise CheckpointError(f"{err}{better_checkpoint(path)}") from None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{path}: not a readable Lightning checkpoint, truncated or "
                              f"damaged ({brief_error(err)}){better_checkpoint(path)}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise CheckpointError(f"{path}: not a KVGateModule checkpoint (no state_dict/hyper_parameters)")
    if not verified:
        warn_unverified(path)  # after reading: a damaged file gets its error line alone
    return ckpt


def _load_deepspeed_checkpoint(folder: Path) -> dict[str, Any]:
    import importlib.util
    import tempfile

    if importlib.util.find_spec("deepspeed") is None:
        raise CheckpointError(f"{folder}: a DeepSpeed checkpoint folder; reading it needs "
                              "pip install 'kvgate[deepspeed]'")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    with tempfile.TemporaryDirectory() as tmp:
        single = Path(tmp) / "consolidated.ckpt"
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(single))
        return load_lightning_checkpoint(single)


def module_from_checkpoint(path: str | os.PathLike) -> KVGateModule:
    """Rebuild the ``KVGateModule`` of a Lightning checkpoint: base loaded, trained tensors in."""
    ckpt = load_lightning_checkpoint(path)
    check_finite(ckpt["state_dict"], f"{path}: not exported")  # before the base loads
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    module = KVGateModule(**hparams)
    module.configure_model()
    info = ckpt.get(CKPT_KEY, {})
    if info.get("fingerprint") not in (None, module.fingerprint):
        raise CheckpointError(
            f"{path}: trained on a base with fingerprint {info['fingerprint']}, but "
            f"{module.base_model!r} now loads with fingerprint {module.fingerprint}")
    want = {name for name, _ in module.trainable_named_parameters()}
    missing = sorted(want - set(ckpt["state_dict"]))
    if missing:
        raise CheckpointError(f"{path}: lacks {len(missing)} trained tensor(s), e.g. {missing[0]!r}")
    module.load_state_dict(ckpt["state_dict"], strict=False)
    module.final_metrics.update(info.get("metrics", {}))
    module.exported_step = ckpt.get("global_step")
    return module


def export_kvzap_checkpoint(source: str | os.PathLike, out: str | os.PathLike,
                            overwrite: bool = False) -> Path:
    """``kvgate export SOURCE OUT --format kvzap``: the ``linear`` / ``mlp`` gates of a
    Lightning checkpoint or of a gated export, written as a KVzap checkpoint
    (``kvgate.checkpoint.kvzap``). A gate KVzap's format cannot hold, or one trained beside
    LoRA (the folder would hold the scorers without the adapter they were trained with), is
    refused in one line before the base loads."""
    from kvgate.checkpoint import export_kvzap, load_gated, read_meta
    from kvgate.checkpoint.kvzap import is_kvzap_folder, kvzap_refusal
    from kvgate.gate import GateConfig

    check_target(check_output_dir(out, "OUT"), overwrite, [source], owned=is_kvzap_folder)
    exported = Path(source).is_dir() and is_gated_export(Path(source))
    if exported:
        meta = read_meta(source)
        gate, lora = meta.get("gate"), meta.get("lora") or meta.get("merged")
    else:
        hparams = load_lightning_checkpoint(source)["hyper_parameters"]
        gate, lora = hparams.get("gate"), hparams.get("train") != "gates"
    config = GateConfig.from_dict(gate) if isinstance(gate, dict) else gate
    why = kvzap_refusal(config) or (lora and "the run trained LoRA beside its gates; KVzap's "
                                    "format holds the scorers alone (export without --format)")
    if why:
        raise CheckpointError(f"{source}: --format kvzap: {why}")
    if exported:
        model, _, meta = load_gated(source)
        base = meta["base"]["id"]
    else:
        module = module_from_checkpoint(source)
        model, base, config = module.model, module.base_model, module.gate_cfg
    return export_kvzap(model, out, gate_config=config, base_model=base, overwrite=overwrite,
                        inputs=(source,))


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, merge: bool = False,
                      overwrite: bool = False) -> Path:
    """Export the Lightning (or DeepSpeed) checkpoint ``ckpt`` to the gated folder ``out``;
    the export records the checkpoint's global step. Returns the folder written.
    ``CheckpointError`` for a checkpoint of step 0 (nothing trained: the export would hold
    the initial gates)."""
    # where it goes is checked before the base loads: a refusal costs nothing
    check_target(check_output_dir(out, "OUT"), overwrite, [ckpt])
    module = module_from_checkpoint(ckpt)
    if module.exported_step == 0:
        raise CheckpointError(f"{ckpt}: global_step 0, the run did no training step; "
                              "there is nothing trained to export")
    return export_module(module, out, merge=merge, overwrite=overwrite,
                         global_step=module.exported_step, inputs=(ckpt,))
