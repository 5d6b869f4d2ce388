"""Shared fixtures: tiny random LLaMA and Mistral models built from configs in well under a second."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """A script of the repository (infer.py, bench/*.py) imported by path: they are not in the
    package, and importing by path runs their definitions but not their `__main__` block."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        **overrides,
    })


def tiny_mistral_config(**overrides) -> MistralConfig:
    # sliding_window smaller than the test sequences so that the window really bites
    return MistralConfig(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 256, "sliding_window": 8, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, **overrides,
    })


def build(config) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = MistralForCausalLM if isinstance(config, MistralConfig) else LlamaForCausalLM
    model = cls(config).to(torch.float32).eval()
    # transformers' default init is tiny (std 0.02): scale weights up so attention is peaked
    # and tests that compare policies or masks see real differences.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture
def tiny_llama():
    return build(tiny_llama_config())


@pytest.fixture
def tiny_mistral():
    return build(tiny_mistral_config())


@pytest.fixture(params=["llama", "mistral"])
def tiny_model(request):
    cfg = tiny_llama_config() if request.param == "llama" else tiny_mistral_config()
    return build(cfg)
