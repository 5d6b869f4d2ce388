"""Cost of the compressed cache against transformers' dense cache, printed as ratios.

    python bench/bench_cache.py            # SmolLM2-135M, 4k-token prompt (a few minutes on CPU)
    python bench/bench_cache.py --quick    # small prompt, for a smoke run

Measures, on one prompt:
- prefill: SnapKV-style compression at ``--evict`` (score + compact) vs a dense-cache prefill;
- decode: tokens/s over ``--decode`` greedy steps after that prefill vs the dense cache;
- KV bytes held vs what the dense cache holds.

Targets (printed as PASS/FAIL): prefill+compression <= 1.10x dense, decode >= 1.15x dense,
bytes <= (1 - evict) x 1.05. Uses ``kvgate.models.load_base("smollm2-135m")`` and falls back
to a random LLaMA of SmolLM2's shape when that cannot be loaded. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvgate.cache import CompressedCache
from kvgate.models import dispatch
from kvgate.models.load import sync_device
from kvgate.policies import get_policy
from kvgate.policies.base import Budget


def smollm2_shape(layers: int = 30) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                       tie_word_embeddings=True)


def load_model(args) -> tuple[torch.nn.Module, str]:
    if not args.random:
        try:
            from kvgate.models import load_base

            model, _ = load_base("smollm2-135m", dtype=args.dtype, device=args.device)
            return model, "smollm2-135m"
        except (ImportError, OSError, RuntimeError, ValueError) as exc:  # fall back, say so
            print(f"(load_base failed: {str(exc).splitlines()[0]}; using a random model)")
    torch.manual_seed(0)
    cfg = smollm2_shape(args.layers)
    model = LlamaForCausalLM(cfg).to(dtype=getattr(torch, args.dtype), device=args.device).eval()
    return model, f"random SmolLM2-shape LLaMA ({args.layers} layers)"


@torch.no_grad()
def prefill(model, ids, cache, device: str) -> tuple[float, torch.Tensor]:
    """(seconds, next token) of one prefill into ``cache``."""
    sync_device(torch.device(device))
    t0 = time.perf_counter()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    sync_device(torch.device(device))
    return time.perf_counter() - t0, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode_interleaved(model, caches: dict, tokens: dict, steps: int, device: str) -> dict:
    """Per-step decode seconds for each cache, alternating the caches step by step so that
    both see the same interference from the rest of the machine."""
    times = {name: [] for name in caches}
    for _ in range(steps):
        for name, cache in caches.items():
            if name == "dense":
                dispatch.uninstall(model)
            else:
                dispatch.install(model)
            sync_device(torch.device(device))
            t0 = time.perf_counter()
            out = model(tokens[name], past_key_values=cache, use_cache=True)
            sync_device(torch.device(device))
            times[name].append(time.perf_counter() - t0)
            tokens[name] = out.logits[:, -1:].argmax(-1)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="512-token prompt, 8 layers, 16 steps")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="decode steps")
    p.add_argument("--evict", type=float, default=0.5, help="evicted share of the prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=30, help="layers of the random fallback")
    p.add_argument("--random", action="store_true", help="skip load_base")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: leave as is; 1 is steadier on a busy machine)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.decode, args.layers, args.random = 512, 16, 8, True
    if args.threads:
        torch.set_num_threads(args.threads)

    model, name = load_model(args)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    policy = get_policy("snapkv")
    budget = Budget(ratio=1.0 - args.evict)

    def dense():
        dispatch.uninstall(model)  # transformers' own attention path, untouched
        return DynamicCache(config=model.config)

    def compressed():
        return CompressedCache(model, policy, budget)  # installs the kvgate routing

    prefill_s = {"dense": [], "compressed": []}
    prefill(model, ids[:, :64], compressed(), args.device)  # warm-up both paths
    prefill(model, ids[:, :64], dense(), args.device)
    caches, tokens = {}, {}
    for _ in range(args.repeats):
        for key, make in (("dense", dense), ("compressed", compressed)):
            caches.pop(key, None)
            cache = make()
            seconds, tokens[key] = prefill(model, ids, cache, args.device)
            prefill_s[key].append(seconds)
            caches[key] = cache
    steps = decode_interleaved(model, caches, tokens, args.decode, args.device)

    # prefill: best of the repeats (interference only ever slows a run down);
    # decode: median step, the steps of both caches interleaved
    best = {k: min(v) for k, v in prefill_s.items()}
    step = {k: statistics.median(v) for k, v in steps.items()}
    dense_cache, comp_cache = caches["dense"], caches["compressed"]
    dense_bytes = sum(layer.keys.numel() * layer.keys.element_size()
                      + layer.values.numel() * layer.values.element_size()
                      for layer in dense_cache.layers)
    prefill_ratio = best["compressed"] / best["dense"]
    decode_ratio = step["dense"] / step["compressed"]
    bytes_ratio = comp_cache.bytes_held() / dense_bytes
    keep = 1.0 - args.evict
    rows = [
        ("prefill time (compressed / dense)", prefill_ratio, prefill_ratio <= 1.10, "<= 1.10"),
        ("decode tokens/s (compressed / dense)", decode_ratio, decode_ratio >= 1.15, ">= 1.15"),
        ("KV bytes (compressed / dense)", bytes_ratio, bytes_ratio <= keep * 1.05,
         f"<= {keep * 1.05:.3f}"),
    ]
    print(f"model: {name}; device {args.device}, {args.dtype}; prompt {args.prompt} tokens; "
          f"snapkv evicting {100 * args.evict:.0f}%; {args.decode} decode steps; "
          f"prefill best of {args.repeats}; torch threads {torch.get_num_threads()}")
    print(f"dense: prefill {1000 * best['dense']:.0f} ms, decode {1 / step['dense']:.2f} tok/s; "
          f"compressed: prefill {1000 * best['compressed']:.0f} ms, decode "
          f"{1 / step['compressed']:.2f} tok/s; kept {100 * comp_cache.kept_fraction():.1f}%")
    for label, value, ok, target in rows:
        print(f"{label:<40} {value:7.3f}  target {target:<8} {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
