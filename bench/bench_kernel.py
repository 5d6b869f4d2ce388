"""The gated-attention kernel alone, forward + backward, kvgate's against the materialised one.

    python bench/bench_kernel.py [--device cuda] [--shapes 1,9,3,2048,64 1,32,32,2048,128]
        [--backward-rows 0 64 256] [--repeats 10] [--profile]

Each shape is B,H,H_kv,n,d (SmolLM2's 9/3 heads of 64, Llama-2-7B's 32/32 of 128), fp32 q, k,
v and a 0/1 gate with ~50% kept, plain causal mask and a recent band of 16. Regimes alternate
repeat by repeat on the same tensors; the median time and the peak memory above the inputs are
printed per regime with its speed-up over ``materialised`` (the n x n gated softmax
differentiated by autograd): the median of the repeats' paired ratios, with its 95% interval.
``--backward-rows R`` adds a kvgate regime whose backward runs R query rows per chunk (0:
kvgate's default for the device). Before timing, every regime's output and four gradients
are checked against the materialised ones, so a faster but wrong setting fails loudly.
``--triton`` adds the Triton kernel on bf16 inputs (``triton_bf16``, as a bf16 model calls
it) and beside it the bar it is held to: SDPA's
FlashAttention backend, causal, no gate, bf16 (``sdpa_flash_bf16``, not checked: it computes
another function, and has no gate gradient).
``--profile`` prints the top CUDA/CPU ops of one kvgate step (torch.profiler).

The whole training step (the frozen model around the kernel) is ``bench/bench_train.py``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.attention import gated as gated_mod
from kvgate.attention.gated import gated_attention, gated_attention_reference
from kvgate.eval.intervals import median_interval
from kvgate.models.load import sync_device

RECENT = 16


def inputs(shape: tuple[int, ...], device: torch.device, seed: int = 0):
    b, h, hk, n, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, hh, n, d, generator=g).to(device).requires_grad_(True)
               for hh in (h, hk, hk))
    gate = (torch.rand(b, hk, n, generator=g) > 0.5).float().to(device).requires_grad_(True)
    return q, k, v, gate


def _bf16(fn):
    """``fn`` fed bf16 copies of q, k, v (the cast is part of the timed step, ~1% at these
    shapes), its output returned in fp32 for the checks."""
    def run(q, k, v, g):
        return fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), g).float()
    return run


def _sdpa_flash(q, k, v, g):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if k.shape[1] != q.shape[1]:  # KV heads repeated to the query heads (counted in the time)
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def regimes(backward_rows: list[int], triton: bool = False) -> dict:
    out = {"materialised": lambda q, k, v, g: gated_attention_reference(q, k, v, g, recent=RECENT)}
    for rows in backward_rows:
        name = "kvgate" if rows == 0 else f"kvgate_bwd{rows}"
        out[name] = functools.partial(gated_attention, recent=RECENT, chunk=rows or None)
    if triton:
        # bf16 inputs only: the tiles in the dtype a bf16 model gives them (fp32 inputs run fp32
        # dots, a second autotuning of every kernel; its correctness is tests/gpu's)
        out["triton_bf16"] = _bf16(functools.partial(gated_attention, recent=RECENT,
                                                     kernel="triton"))
        out["sdpa_flash_bf16"] = _bf16(_sdpa_flash)
    return out


# regimes checked against the materialised kernel relative to the largest reference value
# (half-precision inputs), instead of fp32's absolute tolerances
RELATIVE = {"triton_bf16": 2e-2}
# timed only: not the gated attention (the bar the gated kernel is held to)
UNCHECKED = {"sdpa_flash_bf16"}


def step(fn, tensors, grad_out):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.backward(grad_out)
    return out


def _close(name: str, got, want, atol: float, rtol: float) -> bool:
    """fp32's tolerances, or for a RELATIVE regime a share of the largest reference value."""
    if name in RELATIVE:
        return bool((got.float() - want).abs().max() <= RELATIVE[name] * want.abs().max())
    return torch.allclose(got, want, atol=atol, rtol=rtol)


def check(fns: dict, tensors, grad_out, warn: bool = False) -> None:
    ref = step(fns["materialised"], tensors, grad_out).detach()
    ref_grads = [t.grad.clone() for t in tensors]
    for name, fn in fns.items():
        if name in UNCHECKED:
            step(fn, tensors, grad_out)  # compiled / warmed like the others
            continue
        out = step(fn, tensors, grad_out).detach()
        bad = [i for i, (t, r) in enumerate(zip(tensors, ref_grads))
               if t.grad is None or not _close(name, t.grad, r, 2e-3, 2e-3)]
        if not _close(name, out, ref, 1e-4, 1e-3) or bad:
            msg = (f"{name} disagrees with the materialised kernel "
                   f"(output or gradients {bad} of q, k, v, gate)")
            if not warn:
                raise SystemExit(msg)
            print(f"  WARNING: {msg}; timed anyway (--on-mismatch warn)")


def bench_shape(shape, device, fns: dict, repeats: int, warn: bool = False) -> dict:
    tensors = inputs(shape, device)
    grad_out = torch.randn_like(tensors[0]).mul_(0.1)
    t0 = time.perf_counter()
    check(fns, tensors, grad_out, warn)  # each regime's first call: compilation included
    print(f"  first calls (compilation included): {time.perf_counter() - t0:.1f} s", flush=True)
    times = {name: [] for name in fns}
    peak = {}
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    for i in range(repeats + 1):  # repeat 0 warms up
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync_device(device)
            t0 = time.perf_counter()
            step(fn, tensors, grad_out)
            sync_device(device)
            if i:
                times[name].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak[name] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    # each regime's repeat times too: regimes alternate within a repeat, so ratios pair up
    return {name: (statistics.median(ts), peak.get(name), ts) for name, ts in times.items()}


def paired_ratio(slow: list[float], fast: list[float]) -> str:
    """``slow / fast`` per repeat: their median and its 95% interval, as printed."""
    mid, lo, hi = median_interval([a / b for a, b in zip(slow, fast)])
    return f"{mid:.2f}x [{lo:.2f}, {hi:.2f}]"


def profile(shape, device, fn) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tensors = inputs(shape, device)
    grad_out = torch.randn_like(tensors[0])
    step(fn, tensors, grad_out)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step(fn, tensors, grad_out)
        sync_device(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))


def kernel_shape(text: str) -> tuple[int, ...]:
    """``--shapes`` entry B,H,H_kv,n,d (positive, H a multiple of H_kv): an argparse type."""
    parts = text.split(",")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: want B,H,H_kv,n,d")
    shape = tuple(int(p) for p in parts)
    if shape[1] % shape[2]:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: H must be a multiple of H_kv")
    return shape


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", type=kernel_shape, nargs="+",
                    default=[(1, 9, 3, 2048, 64), (1, 32, 32, 2048, 128)], help="B,H,H_kv,n,d")
    ap.add_argument("--backward-rows", type=int, nargs="+", default=[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--triton", action="store_true",
                    help="add the Triton kernel (bf16 inputs) and SDPA flash (CUDA)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--on-mismatch", choices=["fail", "warn"], default="fail",
                    help="a regime disagreeing with the materialised kernel: stop, or say so "
                         "and time it anyway (a diagnosis, never a result)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.triton and device.type != "cuda":
        raise SystemExit("--triton: the Triton kernel runs on CUDA (its interpreter is for tests)")
    fns = regimes(args.backward_rows, args.triton)
    results = {}
    for shape in args.shapes:
        text = ",".join(map(str, shape))
        _, h, _, n, _ = shape
        rows = gated_mod._rows_per_chunk(h, n, None, device)
        print(f"shape B,H,H_kv,n,d={text} on {device} (default backward rows per chunk: {rows})")
        res = bench_shape(shape, device, fns, args.repeats, args.on_mismatch == "warn")
        ref = res["materialised"][2]
        for name, (sec, mem, times) in res.items():
            mem_txt = "" if mem is None else f", peak +{mem:.2f} GiB"
            print(f"  {name:<16} {sec * 1e3:9.2f} ms{mem_txt}  speed-up vs materialised "
                  f"{paired_ratio(ref, times)}")
        if "triton_bf16" in res:
            print(f"  triton_bf16 / sdpa_flash_bf16 time: "
                  f"{paired_ratio(res['triton_bf16'][2], res['sdpa_flash_bf16'][2])} "
                  f"(target <= 1.5x; median of {args.repeats} paired repeats, 95% interval)")
        if args.profile:
            profile(shape, device, fns["kvgate"] if "kvgate" in fns else next(iter(fns.values())))
        results[text] = res
    if args.triton:  # the tile configs the autotuner settled on (last shape tuned)
        from kvgate.attention import triton_kernel

        for which, kernel in triton_kernel._TUNED.items():
            print(f"  triton {which}: {getattr(kernel, 'best_config', None)}")
    return results


if __name__ == "__main__":
    main()
