"""Diagnostic (CUDA): the Triton kernel's output and four gradients with and without its
far-tile loops, against the materialised fp32 kernel, on bench_kernel's inputs; prints the
relative error (max |a - b| / max |b|) and where dk's largest error sits.

    python experiments/triton_far_check.py 1,32,32,2048,128 1,4,2,520,128
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_kernel import RECENT, inputs, step

from kvgate.attention import triton_kernel
from kvgate.attention.gated import gated_attention, gated_attention_reference

names = ["out", "dq", "dk", "dv", "dg"]
for text in sys.argv[1:]:
    shape = tuple(int(x) for x in text.split(","))
    t = inputs(shape, torch.device("cuda"))
    go = torch.randn_like(t[0]).mul_(0.1)
    ref = [step(lambda *a: gated_attention_reference(*a, recent=RECENT), t, go).detach()]
    ref += [x.grad.clone() for x in t]
    for dtype in (torch.bfloat16, torch.float32):
        for far in (True, False):
            triton_kernel.FAR_TILES = far

            def fn(q, k, v, g, dtype=dtype):
                return gated_attention(q.to(dtype), k.to(dtype), v.to(dtype), g, recent=RECENT,
                                       kernel="triton").float()
            got = [step(fn, t, go).detach()] + [x.grad.clone() for x in t]
            err = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)]
            diff = (got[2].float() - ref[2]).abs().amax(-1)  # dk [B, Hk, n]
            bi, hi, ki = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
            print(f"{text} {str(dtype)[6:]:<9} far={far!s:<5} " +
                  " ".join(f"{n}={e:.2e}" for n, e in zip(names, err)) +
                  f" | dk worst at head {hi} key {ki} (|dk| there {float(ref[2][bi, hi, ki].abs().max()):.3g})",
                  flush=True)
    triton_kernel.FAR_TILES = True
