"""Export a trained model to the gated-checkpoint format.

    python -m kvgate.export CKPT OUT [--merge] [--overwrite]

CKPT is a Lightning checkpoint written by ``train.py`` (gates + LoRA + optimiser state, no
base weights), or a DeepSpeed checkpoint folder (consolidated first; needs deepspeed); the
base is loaded again from the id recorded in it. OUT receives the folder
described in ``kvgate.checkpoint``. ``--merge`` folds LoRA into the base weights and stores
the merged base in OUT/merged (large: a full copy of the model).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from kvgate.checkpoint import CheckpointError, export_gated


def export_module(module, out: str | os.PathLike, merge: bool = False, overwrite: bool = False,
                  global_step: int | None = None) -> Path:
    """Export a built ``KVGateModule`` (after or without training) to ``out``."""
    if module.model is None:
        raise CheckpointError("export: the module's model is not built (call configure_model())")
    training = dict(module.hparams)
    if global_step is not None:
        training["global_step"] = int(global_step)
    return export_gated(
        module.model, out, base_model=module.base_model, fingerprint=module.fingerprint,
        gate_config=module.gate_cfg if module.gated else None, training=training,
        metrics=dict(module.final_metrics), tokenizer=module.tokenizer, merge=merge,
        overwrite=overwrite)


def load_lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a Lightning checkpoint with the safe (weights-only) unpickler. A DeepSpeed
    checkpoint (a folder) is consolidated into one file first."""
    path = Path(path)
    if path.is_dir():
        return _load_deepspeed_checkpoint(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise CheckpointError(f"{path}: not a readable Lightning checkpoint "
                              f"({str(err).splitlines()[0]})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise CheckpointError(f"{path}: not a KVGateModule checkpoint (no state_dict/hyper_parameters)")
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


def module_from_checkpoint(path: str | os.PathLike):
    """Rebuild the ``KVGateModule`` of a Lightning checkpoint: base loaded, trained tensors in."""
    from kvgate.training.module import CKPT_KEY, KVGateModule

    ckpt = load_lightning_checkpoint(path)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="Lightning checkpoint (.ckpt) written by train.py")
    parser.add_argument("out", help="output folder of the gated checkpoint")
    parser.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    try:
        module = module_from_checkpoint(args.ckpt)
        out = export_module(module, args.out, merge=args.merge, overwrite=args.overwrite,
                            global_step=module.exported_step)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
