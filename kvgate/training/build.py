"""Building the model a ``KVGateModule`` trains: the frozen base (optionally quantized), LoRA,
the gates, and the weights of an exported checkpoint to start from.

Order matters: LoRA is added before the gates are patched in (peft must never see the gates'
own projections), and an ``init_from`` checkpoint is loaded last, into both. The checks here
run before anything is loaded, so a config error fails before a multi-GB download.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from kvgate.checkpoint import (
    ADAPTER_DIR,
    CheckpointError,
    check_base,
    load_gate_weights,
    read_meta,
)
from kvgate.gate import GateConfig, gate_modules, patch, set_gates_trainable
from kvgate.models import check_supported, parse_dtype, resolve_model_id
from kvgate.training.errors import TrainingConfigError
from kvgate.training.lora import LoraSettings, add_lora, lora_parameters


def check_quantize(quantize: str) -> None:
    """``quantize`` is ``none``, or ``4bit``/``8bit`` on a machine that can run bitsandbytes."""
    if quantize == "none":
        return
    if quantize not in ("4bit", "8bit"):
        raise TrainingConfigError(
            f"KVGateModule.quantize: must be 'none', '4bit' or '8bit' (got {quantize!r})")
    if not torch.cuda.is_available():
        raise TrainingConfigError(
            f"KVGateModule.quantize={quantize!r} needs a CUDA GPU: bitsandbytes' CPU path gives "
            "wrong LoRA gradients; use quantize: none on the CPU")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise TrainingConfigError(
            f"KVGateModule.quantize={quantize!r} needs bitsandbytes: pip install 'kvgate[bnb]'")


def check_init_from(path: str, train: str) -> None:
    """Fail at config time, before the base loads, on a checkpoint that cannot start this run."""
    try:
        meta = read_meta(path, verify=False)
    except CheckpointError as err:
        raise TrainingConfigError(f"KVGateModule.init_from: {err}") from None
    if meta.get("merged"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} holds a merged base (exported with merge); start "
            "from an unmerged export, whose adapter and gates are separate")
    if train != "lora" and meta.get("gate") is None:
        raise TrainingConfigError(f"KVGateModule.init_from: {path} has no gates to start from")
    if train == "lora" and not meta.get("lora"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} has no LoRA adapter for a train='lora' run to start from")
    if train == "gates" and meta.get("lora"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} has a LoRA adapter, which train='gates' would drop; "
            "train 'gates_lora' to keep it")


def load_quantized(base_model: str, quantize: str, dtype: str, device) -> nn.Module:
    """The base loaded 4-bit or 8-bit by bitsandbytes, which places the weights at load time,
    on ``device`` (this rank's GPU; everything else loads on the CPU and the strategy moves it)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_id(base_model)
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=_bnb_config(quantize, dtype),
        dtype=parse_dtype(dtype), device_map={"": str(device)})
    check_supported(model.config)
    return model


def _bnb_config(quantize: str, dtype: str):
    from transformers import BitsAndBytesConfig

    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def prepare_for_training(model: nn.Module, *, quantized: bool, gradient_checkpointing: bool,
                         lora: LoraSettings | None, gate: GateConfig | None,
                         init_from: str | None) -> nn.Module:
    """Freeze the loaded base, then add what trains: LoRA (``lora``, kept in fp32), then the
    gates (``gate``), then the weights of ``init_from``. Returns the model in train mode (a
    peft wrapper when LoRA was added)."""
    model.requires_grad_(False)
    model.config.use_cache = False
    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        model = add_lora(model, lora)
        for p in lora_parameters(model):
            p.data = p.data.float()
    if gate is not None:
        patch(model, gate)
        set_gates_trainable(model, True)
        # gates of ungated layers never run: frozen, so DDP sees no unused parameters
        for g in gate_modules(model)[: gate.ungated_layers]:
            g.requires_grad_(False)
    if init_from is not None:
        load_init(model, init_from, with_lora=lora is not None)
    # load_base returns eval mode; gradient checkpointing and LoRA dropout need train mode
    model.train()
    return model


def load_init(model: nn.Module, path: str, with_lora: bool) -> None:
    """Copy an exported checkpoint's gates (and adapter, if trained here) into ``model``."""
    try:
        meta = read_meta(path)  # sizes and sha256 checked: a corrupt file fails here
        check_base(meta, path, model)
        if meta.get("gate") is not None and gate_modules(model):
            was, now = meta["gate"].get("kind", "attention"), gate_modules(model)[0].kind
            if was != now:  # said here, not as a tensor-shape mismatch
                raise CheckpointError(f"{path}: holds gates of kind {was!r}, this run trains "
                                      f"kind {now!r}; set gate.kind: {was} or start afresh")
            load_gate_weights(model, path)
        if with_lora and meta.get("lora"):
            load_adapter(model, f"{path}/{ADAPTER_DIR}")
    except CheckpointError as err:
        raise TrainingConfigError(f"KVGateModule.init_from: {err}") from None


def load_adapter(model: nn.Module, folder: str) -> None:
    """Load a saved peft LoRA adapter into the adapter ``model`` already carries; its rank,
    targets and layers must match (``CheckpointError`` otherwise)."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(f"{folder}/adapter_model.safetensors")
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{folder}: adapter cannot be read ({err})") from None
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as err:  # a shape mismatch: another rank or other target modules
        raise CheckpointError(f"{folder}: adapter does not fit this run's LoRA "
                              f"({str(err).splitlines()[0]})") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{folder}: adapter does not fit this run's LoRA (targets or "
                              f"layers differ: {len(missing)} missing, "
                              f"{len(result.unexpected_keys)} unexpected tensors)")
