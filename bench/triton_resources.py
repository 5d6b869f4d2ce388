"""Registers, spilled bytes and shared memory of the Triton gated-attention kernels, per tile
config, compiled for a GPU architecture on any machine: no GPU needed (triton ships ptxas).

    python bench/triton_resources.py [--arch 90] [--shapes 1,32,32,4096,128 1,9,3,4096,64]
        [--dtype bfloat16] [--recent 16] [--extra kv:32,128,8,3 ...] [--first]

Each kernel of ``kvgate.attention.triton_kernel`` (``fwd``, ``kv``, ``q``) is compiled as a
training step would launch it (the same launcher and arguments, so the same specialisation:
operands in the attention layers' [B, n, H, d] layout, plain causal mask, GQA group from the
shape) once per autotuning candidate (``_CANDIDATES``) and per ``--extra`` config
(``KERNEL:BLOCK_M,BLOCK_N,num_warps,num_stages``), and ptxas's resource counts are printed.
A config that spills runs its inner loop through local memory, and a dot off the warpgroup MMA
(Hopper's ``wgmma``, which needs 64+ rows a warpgroup) runs as the older ``mma.sync``; the
autotuner times every candidate, but with ``KVGATE_TRITON_AUTOTUNE=0`` the first one runs
untried, so the first candidate of each kernel should do neither at any head width. Nothing is timed here: speed is
``bench_kernel.py --triton`` on a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("triton_resources: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch
from bench_kernel import kernel_shape

from kvgate.attention import triton_kernel as tk

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _OfflineDriver:
    """What a kernel's warm-up asks of the driver, answered for ``arch`` with no device:
    Triton then specialises and compiles as for a launch, and launches nothing."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


class _Captured:
    """Stands in for a kernel at launch: records its arguments instead of running."""

    def __init__(self, which: str, kernel, calls: dict):
        self.which, self.kernel, self.calls = which, kernel, calls

    def __getitem__(self, grid):
        def record(*args, **consts):
            self.calls[self.which] = (self.kernel, args, consts)
        return record


@contextmanager
def _captured_launches(calls: dict):
    """The launcher hands out recorders (the kernels' own, undecorated by the autotuner); the
    row-term kernel, not a tiled one, is skipped."""
    launcher, row_term = tk._launcher, tk._row_term
    tk._launcher = lambda which, device: (_Captured(which, tk._TILE_KERNELS[which], calls), {})
    tk._row_term = lambda pb, do, out: torch.zeros(pb.b, pb.h, pb.nq)
    try:
        yield
    finally:
        tk._launcher, tk._row_term = launcher, row_term


def launches(shape: tuple[int, ...], dtype: torch.dtype, recent: int) -> dict:
    """{kernel name: (kernel, args, compile-time args)} of one forward + backward at ``shape``
    (B, H, H_kv, n, d), the operands laid out as attention layers hand them."""
    b, h, hk, n, d = shape
    q = torch.zeros(b, n, h, d, dtype=dtype).transpose(1, 2)
    k, v = (torch.zeros(b, n, hk, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    gate = torch.ones(b, hk, n)
    pb = tk._Problem(q, k, v, gate, None, None, d ** -0.5, recent)
    calls: dict = {}
    with _captured_launches(calls):
        out, lse = tk._forward_call(pb)
        tk._backward_call(pb, out, lse, torch.zeros_like(out))
    return calls


def resources(kernel, args, consts: dict, tiles: tuple[int, int, int, int]) -> dict:
    """ptxas's counts for ``kernel`` compiled with ``tiles`` (BLOCK_M, BLOCK_N, warps,
    stages): registers per thread, spilled (local) bytes per thread, shared memory bytes, and
    the dots not on the warpgroup MMA (from the compiled layouts; sm_90 and later have it)."""
    import triton

    bm, bn, warps, stages = tiles
    compiled = kernel.warmup(*args, grid=(1,), **{**consts, "BLOCK_M": bm, "BLOCK_N": bn,
                                                  "num_warps": warps, "num_stages": stages})
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    # spills live in the stack frame (ptxas -v's "bytes stack frame, ... spill stores")
    fields = dict(re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    # a dot left as tt.dot after layout assignment runs as mma.sync: on Hopper the warpgroup
    # MMA (ttng.warp_group_dot) needs >= 64 rows a warpgroup and is the faster
    return {"registers": int(fields["REG"]),
            "spilled": int(fields["STACK"]) + int(fields["LOCAL"]),
            "shared": int(fields["SHARED"]) + compiled.metadata.shared,
            "sync_dots": len(re.findall(r"\btt\.dot\b", compiled.asm["ttgir"]))}


def _tiles(text: str) -> tuple[str, tuple[int, int, int, int]]:
    which, _, numbers = text.partition(":")
    parts = numbers.split(",")
    if which not in tk._CANDIDATES or len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"--extra {text!r}: expected KERNEL:BLOCK_M,BLOCK_N,num_warps,num_stages with KERNEL "
            f"one of {', '.join(tk._CANDIDATES)}")
    bm, bn, warps, stages = (int(p) for p in parts)
    return which, (bm, bn, warps, stages)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    parser.add_argument("--shapes", type=kernel_shape, nargs="+",
                        default=[(1, 32, 32, 4096, 128), (1, 9, 3, 4096, 64)])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--recent", type=int, default=16)
    parser.add_argument("--extra", type=_tiles, nargs="*", default=[])
    parser.add_argument("--first", action="store_true",
                        help="only each kernel's first candidate (what an untuned launch runs)")
    args = parser.parse_args(argv)
    if not tk.triton_available():
        raise SystemExit("triton_resources: needs the triton package (pip install 'kvgate[triton]')")
    import triton
    from triton.runtime import driver

    # for the rest of this process: no kernel can run in it any more, which is all it does
    driver.set_active(_OfflineDriver(args.arch))
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.dtype}, recent {args.recent}")
    rows = []
    for shape in args.shapes:
        calls = launches(shape, DTYPES[args.dtype], args.recent)
        for which, (kernel, call_args, consts) in calls.items():
            candidates = tk._CANDIDATES[which][:1] if args.first else tk._CANDIDATES[which]
            configs = [(c, "candidate") for c in candidates]
            configs += [(c, "extra") for w, c in args.extra if w == which]
            for tiles, kind in configs:
                got = resources(kernel, call_args, consts, tiles)
                rows.append({"shape": shape, "kernel": which, "tiles": tiles, "kind": kind,
                             **got})
                flag = ("  SPILLS" if got["spilled"] else "") + (
                    f"  {got['sync_dots']} DOTS OFF WARPGROUP MMA" if got["sync_dots"] else "")
                print(f"{','.join(map(str, shape)):>16} {which:<4} {kind:<9} "
                      f"{','.join(map(str, tiles)):<13} registers {got['registers']:3d}  "
                      f"spilled {got['spilled']:5d} B  shared {got['shared'] // 1024:4d} KiB"
                      f"{flag}", flush=True)
    return rows


if __name__ == "__main__":
    main()
