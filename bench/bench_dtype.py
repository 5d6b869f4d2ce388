"""fp32 vs bf16 matrix multiplies at SmolLM2-135M's shapes on this CPU, side by side.

    python bench/bench_dtype.py [--tokens 1024] [--repeats 10]

Times ``F.linear`` of a [tokens, 576] input with the MLP's [1536, 576] weight and with the
[49152, 576] LM head in both dtypes and prints bf16 / fp32 (above 1 = bf16 slower). Without AMX
or AVX512-BF16, bf16 matmuls are emulated and slower, which decides the training dtype here.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} tokens={args.tokens}")
    for name, rows in (("mlp [1536 x 576]", 1536), ("lm head [49152 x 576]", 49152)):
        ms = {}
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(args.tokens, 576, dtype=dtype)
            w = torch.randn(rows, 576, dtype=dtype)
            repeats = args.repeats if rows < 10_000 else max(1, args.repeats // 3)
            ms[dtype] = best_ms(lambda x=x, w=w: F.linear(x, w), repeats)
        print(f"  {name:<22} fp32 {ms[torch.float32]:8.2f} ms  bf16 {ms[torch.bfloat16]:8.2f} ms"
              f"  bf16/fp32 {ms[torch.bfloat16] / ms[torch.float32]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
