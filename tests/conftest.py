"""Shared fixtures: tiny random LLaMA and Mistral models built from configs in well under a second."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

# Triton kernels (kernel "triton") run on the CPU only under Triton's interpreter, which is
# chosen when triton is first imported (transformers imports it): so here, before anything
# else. tests/gpu run with TRITON_INTERPRET=0 (bench/gpu_checks.sh) to test the real kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

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


def tiny_qwen2_config(**overrides):
    """Qwen2: LLaMA's layout plus q/k/v biases."""
    from transformers import Qwen2Config

    return Qwen2Config(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **overrides,
    })


def tiny_qwen3_config(**overrides):
    """Qwen3: per-head RMSNorm of q and k before RoPE, an explicit head_dim."""
    from transformers import Qwen3Config

    return Qwen3Config(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        **overrides,
    })


def patch_evicting(model, kind: str = "mlp", **config) -> None:
    """Patch a local gate ``kind`` (mlp or linear) whose output weights are drawn large enough
    that about half the entries fall below tau (a fresh local gate keeps everything)."""
    import kvgate
    from kvgate.gate import GateConfig, gate_modules

    width = {"hidden": 16} if kind == "mlp" else {}  # the linear kind has no inner width
    kvgate.patch(model, GateConfig(kind=kind, gamma=0.0, **width, **config))
    torch.manual_seed(1)
    with torch.no_grad():
        for gate in gate_modules(model):
            out = gate.down if kind == "mlp" else gate.proj
            out.weight.normal_(0.0, 1.0 if kind == "mlp" else 0.5)


def build_causal_lm(config) -> torch.nn.Module:
    """Like ``build`` for any family transformers knows (Qwen2, Qwen3, ...): seeded, with the
    same scaled-up weights; biases and norm weights are randomised too so they matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.15)
            elif p.dim() == 1 and "bias" in name:
                p.normal_(0.0, 0.3)
            elif p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def ragged_store(counts: list[int], batch: int = 1, d: int = 8, seed: int = 0):
    """A ``RaggedStore`` of ``batch`` samples whose KV heads keep ``counts`` entries (the first
    of ``max(counts)`` random ones), and those keys ``[B, H_kv, max, d]``."""
    from kvgate.cache import RaggedStore

    g = torch.Generator().manual_seed(seed)
    hk, n = len(counts), max(counts)
    k, v = torch.randn(batch, hk, n, d, generator=g), torch.randn(batch, hk, n, d, generator=g)
    store = RaggedStore(batch, hk, d, torch.float32, torch.device("cpu"))
    store.append(k, v, torch.arange(n)[None].expand(batch, -1))
    keep = torch.arange(n) < torch.tensor(counts)[:, None]
    store.rebuild(keep[None].expand(batch, -1, -1))
    return store, k
