"""KVzap's checkpoint format (arXiv:2601.07891): its published scorers served as kvgate's local
gates, and kvgate's linear / MLP gates written so that KVzap's loader reads them.

A KVzap checkpoint is what ``save_pretrained`` of kvpress's ``KVzapModel`` writes::

    config.json          model_type "kvzap", input_dim (the base's hidden size), output_dim
                         (its KV heads), hidden_dim (null: one Linear per layer; else
                         Linear -> GELU -> Linear), n_modules (its layers)
    model.safetensors    per layer i: ``layers.{i}.weight`` / ``.bias`` (linear), or
                         ``layers.{i}.0.*`` and ``layers.{i}.2.*`` (MLP, GELU between)

``layers`` is the attribute of kvpress's ``KVzapModel``; ``module_list.{i}...``, the same
tensors under another attribute name, is read too. The scorer reads the normalised hidden
state entering each attention layer (kvgate's local gates read the same), and KVzap keeps an
entry whose raw score is at least a threshold (its README: -4) or that is among the last 128
tokens: the ``local_gate`` policy's ``threshold`` and ``window``.

kvgate's own ``linear`` / ``mlp`` gates are the same scorers: their ``sigmoid(score + gamma) >
tau`` is ``score > logit(tau) - gamma``, so an export in this format records that threshold
(and the whole kvgate gate config) in ``config.json`` under ``"kvgate"``, which KVzap's config
class keeps as an unused attribute; loading such a folder back restores the gate exactly.
Only safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvgate.checkpoint.format import CheckpointError, read_json_object
from kvgate.checkpoint.guards import check_finite
from kvgate.checkpoint.place import check_target, write_through_temporary
from kvgate.files import sha256_file

MODEL_TYPE = "kvzap"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PREFIXES = ("layers", "module_list")  # kvpress' KVzapModel attribute, then the other name
DEFAULT_THRESHOLD = -4.0  # KVzap's README threshold, for a checkpoint that records none
DEFAULT_WINDOW = 128  # KVzap's sliding window (DMS)


def kvzap_config(root: Path) -> dict[str, Any] | None:
    """``config.json`` of a KVzap folder, checked; None when ``root`` holds no KVzap config."""
    config = read_json_object(root / CONFIG)
    if config is None or config.get("model_type") != MODEL_TYPE:
        return None
    for key in ("input_dim", "output_dim", "n_modules"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{root / CONFIG}: KVzap field {key} must be a positive "
                                  f"integer (got {value!r})")
    hidden = config.get("hidden_dim")
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int)
                               or hidden < 1):
        raise CheckpointError(f"{root / CONFIG}: KVzap field hidden_dim must be null or a "
                              f"positive integer (got {hidden!r})")
    return config


def is_kvzap_folder(root: Path) -> bool:
    """Whether ``root`` holds a KVzap config (its fields are not checked here)."""
    config = read_json_object(root / CONFIG)
    return config is not None and config.get("model_type") == MODEL_TYPE


def gate_config_of(config: dict[str, Any], root: Path) -> Any:
    """The ``GateConfig`` a KVzap folder's scorers run as: the one kvgate recorded when it
    wrote the folder, else KVzap's own (raw score >= threshold: gamma 0, tau = sigmoid of the
    threshold; no sinks; the prompt encoded in full, then thresholded, as KVzap's prefill)."""
    from kvgate.gate import GateConfig

    stored = (config.get("kvgate") or {}).get("gate")
    try:
        if isinstance(stored, dict):
            return GateConfig.from_dict(stored)
        threshold = float((config.get("kvgate") or {}).get("threshold", DEFAULT_THRESHOLD))
        hidden = config.get("hidden_dim")
        shape = {"kind": "linear"} if hidden is None else {"kind": "mlp", "hidden": hidden}
        return GateConfig(**shape, gamma=0.0, tau=1.0 / (1.0 + math.exp(-threshold)), alpha=0.0,
                          beta=0.0, prefill="full")
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{root / CONFIG}: bad gate settings ({err})") from None


def kvzap_meta(root: Path, config: dict[str, Any], verify: bool = True) -> dict[str, Any]:
    """What ``read_meta`` gives for a KVzap folder: its base as recorded (a published one
    names none), its gate config, and (``verify``) the size + sha256 of its files, which a
    result store records; a quick look (``gate_kind``) does not hash the weights."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(root.iterdir()) if p.is_file()} if verify else {}
    recorded = config.get("kvgate") or {}
    return {"format": MODEL_TYPE, "base": {"id": recorded.get("base_model")},
            "gate": gate_config_of(config, root).to_dict(), "lora": False, "merged": False,
            "kvzap": {k: config.get(k) for k in ("input_dim", "output_dim", "hidden_dim",
                                                 "n_modules")},
            "threshold": recorded.get("threshold"), "files": files}


def check_kvzap_base(config: dict[str, Any], root: Path, model: nn.Module) -> None:
    """``CheckpointError`` naming the first field where the scorers do not fit ``model``."""
    text = getattr(model.config, "text_config", model.config)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    for field, want, name in (("n_modules", text.num_hidden_layers, "layers"),
                              ("input_dim", text.hidden_size, "hidden size"),
                              ("output_dim", kv_heads, "KV heads")):
        if config[field] != want:
            raise CheckpointError(f"{root}: a KVzap checkpoint for another model: {field} is "
                                  f"{config[field]}, the base has {want} {name}")


def kvzap_layer_states(config: dict[str, Any], root: Path) -> list[dict[str, torch.Tensor]]:
    """Each layer's tensors under kvgate's gate names (``proj.*`` for linear, ``up.*`` /
    ``down.*`` for the MLP), fp32, read from ``model.safetensors``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = root / WEIGHTS
    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{file}: missing, corrupt or truncated ({err})") from None
    prefix = next((p for p in PREFIXES if any(k.startswith(f"{p}.") for k in tensors)), None)
    if prefix is None:
        raise CheckpointError(f"{file}: no tensors named {' or '.join(f'{p}.*' for p in PREFIXES)}")
    names = ({"proj": ""} if config.get("hidden_dim") is None else {"up": ".0", "down": ".2"})
    states = []
    for i in range(config["n_modules"]):  # a loop over layers, at load time
        state = {}
        for ours, theirs in names.items():
            for param in ("weight", "bias"):
                key = f"{prefix}.{i}{theirs}.{param}"
                if key not in tensors:
                    raise CheckpointError(f"{file}: tensor {key} is missing")
                state[f"{ours}.{param}"] = tensors.pop(key).to(torch.float32)
        states.append(state)
    if tensors:
        raise CheckpointError(f"{file}: {len(tensors)} tensor(s) this KVzap config does not "
                              f"describe (e.g. {min(tensors)})")
    return states


def load_kvzap_gates(model: nn.Module, root: Path, config: dict[str, Any]) -> None:
    """Patch ``model`` with the folder's scorers as local gates (its base checked first)."""
    from kvgate.gate import gate_modules, patch

    check_kvzap_base(config, root, model)
    states = kvzap_layer_states(config, root)
    patch(model, gate_config_of(config, root))
    for i, (gate, state) in enumerate(zip(gate_modules(model), states, strict=True)):
        try:
            gate.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise CheckpointError(f"{root / WEIGHTS}: does not fit layer {i}'s gate "
                                  f"({str(err).splitlines()[0]})") from None


def export_kvzap(model: nn.Module, out: str | os.PathLike, *, gate_config: Any,
                 base_model: str | None = None, overwrite: bool = False,
                 inputs=()) -> Path:
    """Write ``model``'s ``linear`` / ``mlp`` gates as a KVzap checkpoint at ``out``, with the
    threshold that reproduces their own eviction (``logit(tau) - gamma``) recorded beside the
    KVzap fields. Refused in one line for a gate KVzap's format cannot hold."""
    from safetensors.torch import save_file

    from kvgate.gate import gate_modules

    why = kvzap_refusal(gate_config)
    if why:
        raise CheckpointError(f"--format kvzap: {why}")
    gates = gate_modules(model)
    text = getattr(model.config, "text_config", model.config)
    tensors = {}
    names = {"proj": ""} if gate_config.kind == "linear" else {"up": ".0", "down": ".2"}
    for i, gate in enumerate(gates):  # a loop over layers, at export time
        for key, value in gate.state_dict().items():
            ours, param = key.split(".")
            tensors[f"{PREFIXES[0]}.{i}{names[ours]}.{param}"] = value.detach().to(
                "cpu", torch.float32).contiguous()
    tau, gamma = gate_config.tau, gate_config.gamma
    config = {"model_type": MODEL_TYPE, "architectures": ["KVzapModel"],
              "input_dim": int(text.hidden_size), "output_dim": int(gates[0].out_heads),
              "hidden_dim": None if gate_config.kind == "linear" else int(gate_config.hidden),
              "n_modules": len(gates), "torch_dtype": "float32",
              "kvgate": {"threshold": math.log(tau / (1.0 - tau)) - gamma,
                         "sliding_window_size": DEFAULT_WINDOW, "base_model": base_model,
                         "gate": gate_config.to_dict()}}
    out = Path(out)
    check_finite(tensors, str(out))
    check_target(out, overwrite, inputs, owned=is_kvzap_folder)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")

    return write_through_temporary(out, fill)


def kvzap_refusal(gate_config: Any) -> str | None:
    """Why a gate of ``gate_config`` has no KVzap equivalent, or None."""
    if gate_config is None:
        return "the checkpoint has no gates"
    if gate_config.kind not in ("linear", "mlp"):
        return (f"a gate of kind {gate_config.kind!r} reads the tokens around each one; KVzap's "
                "format holds scorers of one token's hidden state (kinds linear and mlp)")
    if gate_config.target != "kv":
        return "KVzap scores one entry per KV head; this gate scores query heads (target query)"
    if gate_config.ungated_layers:
        return "this gate leaves its first layers ungated (ungated_layers); KVzap gates every layer"
    return None
