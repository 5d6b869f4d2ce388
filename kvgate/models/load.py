"""Load a base model + tokenizer from an alias, a local folder, a GGUF file or a hub id.

``load_base`` accepts:
- an embedded alias (``smollm2-135m``): the GGUF inside an installed package, converted
  once into ``$KVGATE_CACHE/models/<alias>`` (see ``kvgate.models.gguf``);
- a local Hugging Face folder (with ``config.json``);
- a local ``.gguf`` file, converted once like an alias;
- a hub id, through ``from_pretrained``. When the hub cannot be reached it falls back to
  the local hub cache and otherwise fails in seconds, instead of retrying for minutes.

Run ``kvgate prepare smollm2-135m`` to do the one-time conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvgate.hub import hub_offline_reason
from kvgate.models.arch import check_supported, parse_dtype
from kvgate.models.errors import ModelLoadError
from kvgate.models.gguf import EMBEDDED, cache_root, convert_gguf, is_converted, prepare_embedded


def sync_device(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock reading covers them (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, checked to exist on this machine before any weights are
    read: an unknown name, a CUDA device on a CPU-only torch, or a GPU index past the last one
    raises ``ModelLoadError`` in one line (torch itself fails late, in a long traceback)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"device {str(device)!r} is not a device torch knows; use cpu, "
                             "cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    backend = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        why = ("this torch is built without CUDA (CPU only)"
               if dev.type == "cuda" and torch.version.cuda is None and torch.version.hip is None
               else f"no {dev.type} device is available here")
        raise ModelLoadError(f"device {str(device)!r}: {why}; use --device cpu")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ModelLoadError(f"device {str(device)!r}: this machine has {count()} {dev.type} "
                             f"device(s), numbered from 0")
    return dev


def weights_fingerprint(name_or_path: str | os.PathLike) -> str | None:
    """A short digest of a local model folder's weights (file names and sizes) and config, so
    that results of a folder whose weights were replaced are not taken for its old ones; None
    for a hub id (its name is its identity)."""
    name_or_path = os.fspath(name_or_path)
    if name_or_path not in EMBEDDED and not _looks_like_path(name_or_path):
        return None
    folder = Path(resolve_model_id(name_or_path))
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".gguf"):
            digest.update(f"{path.name}|{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(name))


def _gguf_cache_dir(gguf_path: Path) -> Path:
    # keyed by the file's identity so a replaced file is converted again
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return cache_root() / "models" / f"{gguf_path.stem}-{key.hexdigest()[:8]}"


def resolve_model_id(name_or_path: str | os.PathLike) -> str:
    """Stable identifier of a model source, as recorded in checkpoint metadata.

    An alias maps to its converted folder, a local path to its absolute form, a hub id to itself.
    """
    name_or_path = os.fspath(name_or_path)
    if name_or_path in EMBEDDED:
        return str(prepare_embedded(name_or_path))
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser().resolve()
        return str(_gguf_cache_dir(path)) if path.suffix == ".gguf" else str(path)
    return name_or_path


def _from_folder(folder: str | Path, dtype: torch.dtype | None, model_kwargs: dict[str, Any],
                 **hub_kwargs: Any) -> tuple[Any, Any]:
    """(model, tokenizer); dtype None reads the tokenizer alone: (None, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **hub_kwargs)
    if dtype is None:
        return None, tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **model_kwargs,
                                                 **hub_kwargs)
    return model, tokenizer


def _from_hub(repo_id: str, dtype: torch.dtype | None,
              model_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    reason = hub_offline_reason()
    if reason is None:
        try:
            return _from_folder(repo_id, dtype, model_kwargs)
        except OSError as err:
            raise ModelLoadError(f"could not load {repo_id!r} from the hub: "
                                 f"{str(err).splitlines()[0]}") from err
    try:  # offline: a copy in the local hub cache still works
        return _from_folder(repo_id, dtype, model_kwargs, local_files_only=True)
    except OSError as err:
        raise ModelLoadError(
            f"cannot load {repo_id!r}: the Hugging Face hub is unreachable ({reason}) and the "
            f"model is not in the local hub cache; download it elsewhere and pass its local "
            f"folder (with config.json) instead, or use the embedded alias "
            f"{', '.join(EMBEDDED)}"
        ) from err


def _load_any(name_or_path: str, dtype: torch.dtype | None,
              model_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if name_or_path in EMBEDDED:
        return _from_folder(prepare_embedded(name_or_path), dtype, model_kwargs)
    if not _looks_like_path(name_or_path):
        return _from_hub(name_or_path, dtype, model_kwargs)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        folder = _gguf_cache_dir(path)
        if not is_converted(folder):
            convert_gguf(path, folder, name=path.stem)
        return _from_folder(folder, dtype, model_kwargs)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} is not a Hugging Face model folder (no config.json)")
    try:
        return _from_folder(path, dtype, model_kwargs)
    except OSError as err:
        raise ModelLoadError(f"could not load the model folder {str(path)!r}: "
                             f"{str(err).splitlines()[0]}") from err


def load_base(name_or_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
              device: str | torch.device = "cpu",
              require_supported: bool = True, **model_kwargs: Any) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    dtype: a torch dtype or "float32"/"fp32"/"bfloat16"/"bf16"/"float16"/"fp16".
    require_supported: refuse (``UnsupportedArchitectureError``) anything but LLaMA/Mistral,
    checked on the config before any weights are read when the config is local.
    model_kwargs: passed to ``from_pretrained`` (``quantization_config``,
    ``attn_implementation``...). A quantised model is placed with ``device_map``, because
    bitsandbytes models cannot be moved with ``.to`` after loading.
    The tokenizer always has a pad token (the EOS token if it had none). A device that does
    not exist here is refused (``check_device``) before anything is read.
    """
    name_or_path, dtype = os.fspath(name_or_path), parse_dtype(dtype)
    check_device(device)
    if require_supported:
        _check_config_early(name_or_path)
    placed = "device_map" in model_kwargs or "quantization_config" in model_kwargs
    if placed:
        model_kwargs.setdefault("device_map", {"": str(device)})
    model, tokenizer = _load_any(name_or_path, dtype, model_kwargs)
    if require_supported:
        check_supported(model.config)
    _ensure_pad(tokenizer)
    if not placed:
        model = model.to(device)
    return model.eval(), tokenizer


def load_tokenizer(name_or_path: str | os.PathLike) -> Any:
    """The tokenizer of a base model (alias, local folder, GGUF, hub id) without its weights,
    with a pad token as ``load_base`` gives it: for data that must be tokenised before the
    model is built (DeepSpeed asks for the training loader first, to size its batches)."""
    _, tokenizer = _load_any(os.fspath(name_or_path), None, {})
    return _ensure_pad(tokenizer)


def pad_id(tokenizer: Any) -> int:
    """A token id to put at padding (never attended, never scored): the pad token, else EOS,
    else BOS, else 0."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _ensure_pad(tokenizer: Any) -> Any:
    # batches are padded: a tokenizer without a pad token pads with EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_config_early(name_or_path: str) -> None:
    # a local folder's config is cheap to read: refuse a wrong family before loading weights
    if name_or_path in EMBEDDED or not _looks_like_path(name_or_path):
        return
    config_file = Path(name_or_path).expanduser() / "config.json"
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except (ValueError, AttributeError) as err:
            raise ModelLoadError(f"{config_file} is not a valid JSON config") from err
        check_supported(SimpleNamespace(model_type=model_type))
