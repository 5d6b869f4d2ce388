"""Forward+backward time of one gated decoder layer vs the same layer with plain SDPA.

SmolLM2-135M shapes (hidden 576, 9 query heads, 3 KV heads, head_dim 64), fp32, batch 1.
Both variants run side by side in one process and the ratio is printed. Target: <= 2.5x at
n = 1024 on the CPU.

    python bench/bench_gate.py [--lengths 512 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvgate
from kvgate.gate import gates_open


def smollm2_layer_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def time_fwd_bwd(model, x, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # first run warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model.model(inputs_embeds=x).last_hidden_state
        out.square().mean().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = smollm2_layer_model()
    kvgate.patch(model, kvgate.GateConfig(gamma=0.0))
    print(f"{'n':>6} {'sdpa ms':>10} {'gated ms':>10} {'ratio':>7}")
    for n in args.lengths:
        x = torch.randn(1, n, 576, requires_grad=True)
        with gates_open(model):
            plain = time_fwd_bwd(model, x, args.repeats)
        gated = time_fwd_bwd(model, x, args.repeats)
        print(f"{n:>6} {plain * 1e3:>10.1f} {gated * 1e3:>10.1f} {gated / plain:>7.2f}")


if __name__ == "__main__":
    main()
