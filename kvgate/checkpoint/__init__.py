"""The gated-checkpoint format: what training exports and inference loads.

A gated checkpoint is a folder::

    kvgate_config.json   format version, base model id + fingerprint (and the architecture
                         fields it hashes, so a mismatch names the field), gate config,
                         training config, final metrics, size + sha256 of every file below
    gates.safetensors    gate weights, keys "<layer>.<param>" (absent when nothing is gated)
    adapter/             the LoRA adapter in peft's own format (absent without LoRA)
    merged/              with --merge: the base with LoRA merged in, a Hugging Face folder
    tokenizer/           the tokenizer, so loading needs nothing but the base weights

Only safetensors and JSON: nothing is unpickled. The folder is written in a temporary sibling
``.NAME.tmp-PID@HOST-XXXX`` and renamed into place, so a failed export leaves no half-written
checkpoint behind. A killed export cannot clean up after itself: the next export into the same
folder removes the temporaries whose process is gone (same host, pid not running; those of an
older kvgate, with no pid in the name, once untouched for a day). An OS error while writing
(no space, no permission, a file where a folder should be) is a ``CheckpointError`` naming OUT.
``overwrite`` replaces only a gated export or an empty folder (``place.py``: where an export
goes, its temporaries and the rename into place).

This module never imports the training package: inference depends on it alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvgate.checkpoint.fetch import checkpoint_folder
from kvgate.checkpoint.format import (
    ADAPTER_DIR,
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    GATES_NAME,
    MERGED_DIR,
    TOKENIZER_DIR,
    CheckpointError,
    is_gated_export,
)
from kvgate.checkpoint.guards import check_finite, not_an_export
from kvgate.checkpoint.kvzap import MODEL_TYPE as KVZAP
from kvgate.checkpoint.kvzap import export_kvzap, kvzap_config, kvzap_meta, load_kvzap_gates
from kvgate.checkpoint.place import (
    check_target,
    remove_stale_temporaries,
    write_through_temporary,
)
from kvgate.files import sha256_file
from kvgate.models.load import check_device

__all__ = ["ADAPTER_DIR", "CONFIG_NAME", "FORMAT", "FORMAT_VERSION", "GATES_NAME", "MERGED_DIR",
           "TOKENIZER_DIR", "CheckpointError", "check_base", "export_gated", "export_kvzap",
           "gate_kind", "gate_state", "is_gated_export", "load_gate_weights", "load_gated",
           "merged_state", "read_meta", "remove_stale_temporaries", "sha256_file"]


# ----------------------------------------------------------------------------- helpers
def _inventory(root: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``root`` except the config, by relative path."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != CONFIG_NAME:
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _has_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and any(".lora_" in n for n, _ in model.named_parameters())


def gate_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gate tensors keyed ``"<layer>.<param>"``: independent of peft's name prefixes."""
    from kvgate.gate import gate_modules

    return {f"{i}.{k}": v.detach().to("cpu", torch.float32).contiguous()
            for i, gate in enumerate(gate_modules(model)) for k, v in gate.state_dict().items()}


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Base weights with every LoRA update added (W + scale * B @ A), without changing
    ``model``; gate tensors are left out (they go to gates.safetensors)."""
    base = _unwrap(model)
    deltas = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            for adapter in getattr(module, "active_adapters", []):
                delta = module.get_delta_weight(adapter).detach()
                deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + delta
    state = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or "kv_gate." in key:
            continue
        key = key.replace(".base_layer.", ".")
        value = value.detach()
        if key in deltas:
            value = (value.float() + deltas[key].float()).to(value.dtype)
        state[key] = value.to("cpu").contiguous()
    return state


# ------------------------------------------------------------------------------ export
def export_gated(model: nn.Module, out: str | os.PathLike, *, base_model: str, fingerprint: str,
                 gate_config: Any | None = None, training: dict[str, Any] | None = None,
                 metrics: dict[str, float] | None = None, tokenizer: Any = None,
                 merge: bool = False, overwrite: bool = False,
                 inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``model``'s gates (+ LoRA adapter, or the merged base with ``merge``) to ``out``.

    ``model``: a patched (and/or peft-wrapped) LLaMA, Mistral or Qwen model. ``gate_config``: the
    ``GateConfig`` the gates were built with (None when not gated). Returns ``out``.
    Raises ``CheckpointError`` when ``out`` exists and ``overwrite`` is False, and, even with
    it, unless ``out`` is a gated export or an empty folder that holds none of ``inputs`` (the
    checkpoint being exported): ``kvgate.checkpoint.place.check_target``.
    """
    from safetensors.torch import save_file

    out = Path(out)
    check_target(out, overwrite, inputs)

    def fill(tmp: Path) -> None:
        gates = gate_state(model)
        check_finite(gates, f"{out}: not exported")  # a diverged run's gates are no model
        if gates:
            save_file(gates, str(tmp / GATES_NAME), metadata={"format": FORMAT})
        lora = _has_lora(model)
        if lora and merge:
            base = _unwrap(model)
            base.save_pretrained(tmp / MERGED_DIR, state_dict=merged_state(model))
        elif lora:
            model.save_pretrained(tmp / ADAPTER_DIR)
            (tmp / ADAPTER_DIR / "README.md").unlink(missing_ok=True)  # peft's model card
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
            if lora and merge:
                tokenizer.save_pretrained(tmp / MERGED_DIR)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "base": {"id": base_model, "fingerprint": fingerprint,
                     "architecture": _architecture(model)},
            "gate": gate_config.to_dict() if gate_config is not None else None,
            "lora": lora and not merge,
            "merged": lora and merge,
            "training": training or {},
            "metrics": metrics or {},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": _inventory(tmp),
        }
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True, default=str)

    return write_through_temporary(out, fill)


def _architecture(model: nn.Module) -> dict[str, Any] | None:
    """The base's architecture fields (what its fingerprint hashes), stored so that a base
    that does not match can be told which field differs; None for a model without a config."""
    from kvgate.models.arch import architecture_fields

    config = getattr(_unwrap(model), "config", None)
    if getattr(config, "model_type", None) is None:
        return None
    return json.loads(json.dumps(architecture_fields(config), default=str))


# -------------------------------------------------------------------------------- load
def read_meta(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Parse and check ``kvgate_config.json``; with ``verify`` also every listed file's
    size and sha256. Raises ``CheckpointError`` naming what is wrong."""
    root = checkpoint_folder(path)  # a hub id is fetched (once) here
    kvzap = kvzap_config(root)
    if kvzap is not None:  # NVIDIA's KVzap scorers: served as local gates (kvzap.py)
        return kvzap_meta(root, kvzap, verify)
    config = root / CONFIG_NAME
    if not config.is_file():  # every --checkpoint comes here: a .ckpt gets the export line
        raise not_an_export(root)
    try:
        with open(config, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config}: corrupt or truncated ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{config}: not a {FORMAT} config")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{config}: unknown format_version {version!r} (this kvgate reads {FORMAT_VERSION})")
    for key in ("base", "files"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(f"{config}: field {key!r} is missing or malformed")
    if verify:
        for rel, info in meta["files"].items():
            file = root / rel
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in {CONFIG_NAME})")
            size = file.stat().st_size
            if size != info.get("bytes"):
                raise CheckpointError(
                    f"{file}: truncated or corrupt ({size} bytes, expected {info.get('bytes')})")
            if sha256_file(file) != info.get("sha256"):
                raise CheckpointError(f"{file}: corrupt (sha256 does not match {CONFIG_NAME})")
    return meta


def gate_kind(path: str | os.PathLike) -> str | None:
    """The gate kind a checkpoint's config records, read without checking its files: None
    when it is not gated or cannot be read (loading it then says why); "attention" for exports
    written before ``GateConfig.kind`` existed."""
    try:
        gate = read_meta(path, verify=False).get("gate")
    except CheckpointError:
        return None
    return gate.get("kind", "attention") if isinstance(gate, dict) else None


def _load_base_for(meta: dict[str, Any], root: Path, base: Any, dtype: Any) -> tuple[Any, Any]:
    from kvgate.models import load_base

    if meta.get("merged"):
        if base is not None:
            raise CheckpointError(f"{root}: holds its own merged base ({MERGED_DIR}/); "
                                  "do not pass base=")
        return load_base(str(root / MERGED_DIR), dtype=dtype)
    if base is None:
        return load_base(meta["base"]["id"], dtype=dtype)
    if isinstance(base, (str, os.PathLike)):
        return load_base(str(base), dtype=dtype)
    if isinstance(base, tuple):
        return base
    return base, None


def check_base(meta: dict[str, Any], root: str | os.PathLike, model: nn.Module) -> None:
    """``CheckpointError`` unless ``model`` has the architecture the checkpoint was trained on."""
    from kvgate.models import model_fingerprint
    from kvgate.models.arch import architecture_fields

    config = _unwrap(model).config
    found = model_fingerprint(config)
    want = meta["base"].get("fingerprint")
    if found == want:
        return
    trained = f"{root}: base model mismatch: the checkpoint was trained on {meta['base'].get('id')!r}"
    stored = meta["base"].get("architecture")
    if isinstance(stored, dict):  # exports since the fields were stored: name the first
        given = json.loads(json.dumps(architecture_fields(config), default=str))
        differ = [k for k in sorted(set(stored) | set(given)) if stored.get(k) != given.get(k)]
        if differ:
            field = differ[0]
            more = f" (and {len(differ) - 1} more field(s))" if len(differ) > 1 else ""
            raise CheckpointError(f"{trained}, whose {field} is {stored.get(field)!r}; the "
                                  f"given base has {field} {given.get(field)!r}{more}")
    raise CheckpointError(f"{trained} (fingerprint {want}), the given base has fingerprint "
                          f"{found}")


def load_gate_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy ``gates.safetensors`` of the checkpoint at ``path`` into ``model``'s patched gates.

    Raises ``CheckpointError`` when the file is missing or corrupt, or its tensors do not fit
    the model's gates (another gate size, or another number of layers).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from kvgate.gate import gate_modules

    file = Path(path) / GATES_NAME
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the config says the model is gated)")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: corrupt or truncated ({err})") from None
    check_finite(tensors, str(file))
    gates = gate_modules(model)
    if not gates:
        raise CheckpointError(f"{file}: the model has no gates to load it into")
    for i, gate in enumerate(gates):
        prefix = f"{i}."
        part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            gate.load_state_dict(part, strict=True)
        except RuntimeError as err:
            raise CheckpointError(f"{file}: does not fit layer {i}'s gate "
                                  f"({str(err).splitlines()[0]})") from None
    extra = len(tensors) - sum(len(g.state_dict()) for g in gates)
    if extra:
        raise CheckpointError(f"{file}: {extra} tensor(s) for layers the base does not have")


def load_gated(path: str | os.PathLike, base: Any = None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", merge_lora: bool = True,
               verify: bool = True) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Rebuild a gated model from an exported folder, a KVzap checkpoint folder (NVIDIA's
    published scorers, served as local gates: ``kvgate.checkpoint.kvzap``) or a hub id of
    either -> (model, tokenizer, meta).

    base: None (load the recorded base id; a published KVzap checkpoint records none), a
    name/path for ``kvgate.models.load_base``, a loaded model, or a (model, tokenizer) pair.
    Its architecture must match the checkpoint's (a KVzap checkpoint's layers, hidden size and
    KV heads). dtype: of the base weights (gates stay fp32). merge_lora: fold LoRA into
    the weights and return a plain transformers model (default; faster, and what the cache
    and engine expect); False keeps peft's wrapper, whose logits equal training's bit for bit.
    Raises ``CheckpointError`` on a mismatched base, a missing/corrupt file or an unknown
    format version. The model is returned in eval mode with every parameter frozen.
    """
    from safetensors import SafetensorError

    from kvgate.gate import GateConfig, patch

    check_device(device)  # before anything is read: torch would fail late, in a traceback
    root = checkpoint_folder(path)
    meta = read_meta(root, verify=verify)
    if meta["format"] == KVZAP:
        if base is None and meta["base"]["id"] is None:
            raise CheckpointError(f"{path}: a KVzap checkpoint names no base model: pass "
                                  "base= (Python) or --base (command line)")
        model, tokenizer = _load_base_for(meta, root, base, dtype)
        load_kvzap_gates(model, root, kvzap_config(root))
        model.requires_grad_(False)
        return model.to(device).eval(), tokenizer, meta
    model, tokenizer = _load_base_for(meta, root, base, dtype)
    check_base(meta, root, model)
    if meta.get("lora"):
        from peft import PeftModel

        adapter = root / ADAPTER_DIR
        if not (adapter / "adapter_config.json").is_file():
            raise CheckpointError(f"{adapter}: missing (the config says the checkpoint has LoRA)")
        try:
            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
        except (OSError, ValueError, SafetensorError) as err:
            raise CheckpointError(f"{adapter}: cannot be loaded ({str(err).splitlines()[0]})") from None
        if merge_lora:
            model = model.merge_and_unload()
    if meta.get("gate") is not None:
        try:
            config = GateConfig.from_dict(meta["gate"])
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{root / CONFIG_NAME}: bad gate config ({err})") from None
        patch(model, config)
        load_gate_weights(model, root)
    tok_dir = root / TOKENIZER_DIR
    if tok_dir.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    model.requires_grad_(False)
    return model.to(device).eval(), tokenizer, meta
