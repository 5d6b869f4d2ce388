"""Gated attention as FlashAttention-2-style Triton kernels: the fast path for training on CUDA.

Same contract and rules as ``kvgate.attention.gated`` (read its docstring for the masks and the
closed-form gate gradient of eq. 5 of the Attention-Gate paper). Eq. 5 is causal attention with
a per-key keep flag plus an always-visible band, so it runs as FlashAttention does (Dao, 2023,
"FlashAttention-2"): tiles of queries over tiles of keys, an online softmax, only the row
log-sum-exp kept for the backward, tiles wholly above the diagonal never visited.

The kernels live in ``kvgate.attention.triton_tiles``; this module launches them.

- forward (``_forward``): one program per (batch, query head, query tile); the keep flags, the
  base mask (causal, padding, sliding window), the recent band and the one-shot prompt rule
  are evaluated per element from O(n) vectors, so no n x n tensor exists;
- backward, two kernels over the same tiles as FlashAttention-2's:
  ``_backward_kv`` (one program per (batch, KV head, key tile), looping over the query heads
  of its group and the query tiles that can see the keys) accumulates dk, dv and the gate
  gradient ``dL/dg_t = sum_j P~_jt (dO_j . v_t - D_j)`` over the gated region, where
  ``P~_jt = exp(s_jt - lse_j)`` is the probability with the gate ignored (clamped at
  ``EXP_CLAMP``, as the chunked kernel does). Every factor is one a flash backward forms
  anyway (``dO_j . v_t`` for dS, ``D_j`` the row term), so the gate costs a masked sum;
  ``_backward_q`` (one program per query tile) accumulates dq. Neither needs atomics.

The base mask: ``allowed`` [B, 1, nq, n] is read once per call. When every row allows one
contiguous run of keys (causal, left padding and a sliding window all do) it is reduced to
two int32 vectors (first and last allowed key per row) and key tiles outside every row's run
are skipped; any other mask is read per tile as int8.

Operands are read in place through their strides (only the head dimension's must be 1): the
attention layers hand q, k and v as [B, H, n, d] views of [B, n, H, d] projections, and a copy of
each, of the output and of dO would add a pass over memory per tensor and layer beside a kernel
that reads each once per tile row. The output is written in the layers' [B, n, H, d] layout (their
transpose back is then free), the gradients in their inputs' layouts, and the backward's row term
``D_j = dO_j . o_j`` is one more small kernel (``_row_dot``) instead of fp32 copies of both.

Operands enter the tiles in their own dtype (bf16 / fp16 on tensor cores, fp32 exactly:
``input_precision="ieee"``); softmax statistics and every accumulation are fp32. On the CPU the
kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is
imported): that is how the test suite checks them against the chunked kernel.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from kvgate.attention.common import EXP_CLAMP
from kvgate.attention.masks import memoised
from kvgate.attention.triton_tiles import triton

if triton is not None:
    from kvgate.attention.triton_tiles import _backward_kv, _backward_q, _forward, _row_dot

    # the tiled kernels, by the name a launch (and its tile candidates) goes by
    _TILE_KERNELS = {"fwd": _forward, "kv": _backward_kv, "q": _backward_q}


LOG2E = 1.4426950408889634
# the backward's clamp on P~ in the kernels' base-2 exponent units
_CLAMP2 = EXP_CLAMP * LOG2E
# masks the mask vectors can take (a constexpr of every kernel)
_MASK_NONE, _MASK_RUNS, _MASK_DENSE = 0, 1, 2


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel on CUDA, tuned once per head
# width and mask kind (Triton's autotuner; FlashAttention-2's usual shapes): a config that
# does not fit the chip's shared memory is skipped by the tuner. Registers on an H100 at head
# widths 64 and 128 (bench/triton_resources.py, triton 3.6 and 3.9): the key-tile kernel holds
# two fp32 [BLOCK_N, d] accumulators, and at 4 warps each of its former candidates spilled at
# 128. The first of each kernel, which an untuned launch runs, spills under neither version;
# the others at most 80 B a thread (kv's, 3.9 only).
_CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3)],
    "kv": [(32, 64, 8, 3), (32, 128, 8, 3), (64, 64, 8, 2), (16, 128, 8, 3)],
    "q": [(64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 3), (128, 64, 8, 2)],
}
# under the interpreter (tests): small tiles, so several tiles and their edges are exercised
_INTERPRETER_TILES = (16, 16, 4, 1)
# rows per program of the row-term kernel (one load of each operand, no loop): on CUDA a tile
# that keeps BLOCK_D-wide fp32 rows in registers; under the interpreter the tests' tile
_ROW_TILE = {"cuda": (64, 4), "interpreter": (16, 1)}
_TUNE_KEY = ["D", "MASK_MODE", "HAS_PROMPT", "PRECISION"]


def _tuned(kernel, which: str):
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
               for bm, bn, w, st in _CANDIDATES[which]]
    return triton.autotune(configs=configs, key=_TUNE_KEY)(kernel)


_TUNED: dict = {}


def _fixed(tiles: tuple[int, int, int, int]) -> dict:
    bm, bn, warps, stages = tiles
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def _launcher(which: str, device: torch.device):
    """(kernel, tile kwargs): the autotuned kernel on CUDA, fixed small tiles elsewhere."""
    kernel = _TILE_KERNELS[which]
    if device.type != "cuda":
        return kernel, _fixed(_INTERPRETER_TILES)
    if os.environ.get("KVGATE_TRITON_AUTOTUNE", "1") == "0":
        # the first candidate, untuned: tests compile one config per shape instead of four
        return kernel, _fixed(_CANDIDATES[which][0])
    if which not in _TUNED:
        _TUNED[which] = _tuned(kernel, which)
    return _TUNED[which], {}


def _mask_vectors(allowed: Tensor | None, n: int, device: torch.device):
    """(mode, lo, hi, dense) for the kernels from the base mask [B, 1, nq, n] bool or None.

    Each row's allowed keys form one contiguous run [lo, hi] under causal, left-padding and
    sliding-window masks: then two int32 vectors carry the mask and key tiles outside every
    row's run are skipped. Any other pattern is passed as dense int8 [B, nq, n]."""
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    if allowed is None:
        return _MASK_NONE, dummy, dummy, dummy.to(torch.int8)
    rows = allowed[:, 0]
    count = rows.sum(-1, dtype=torch.int32)
    lo = rows.to(torch.int8).argmax(-1).to(torch.int32)
    hi = (n - 1 - rows.flip(-1).to(torch.int8).argmax(-1)).to(torch.int32)
    empty = count == 0
    runs = ((hi - lo + 1 == count) | empty).all()
    # a plain causal mask (what transformers builds for an unpadded batch) is no mask at all:
    # the kernels then read no mask vectors
    diagonal = torch.arange(n - rows.shape[1], n, device=device, dtype=torch.int32)
    causal = ((lo == 0) & (hi == diagonal) & ~empty).all()
    runs, causal = torch.stack([runs, causal]).tolist()  # one device sync for both
    if causal:
        return _MASK_NONE, dummy, dummy, dummy.to(torch.int8)
    if runs:
        # an empty row sees only its diagonal (set in the kernel): a run that holds no key
        lo = torch.where(empty, torch.full_like(lo, n), lo).contiguous()
        hi = torch.where(empty, torch.full_like(hi, -1), hi).contiguous()
        return _MASK_RUNS, lo, hi, dummy.to(torch.int8)
    return _MASK_DENSE, dummy, dummy, rows.to(torch.int8).contiguous()


def _in_place(t: Tensor) -> Tensor:
    """``t`` as the kernels can read it: itself when its head dimension is contiguous (any
    other strides are passed to the kernels), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _Problem:
    """Everything the three kernels share for one call: the operands as they came (see
    ``_in_place``), the keep flags as int8, the mask vectors and the scalar arguments."""

    def __init__(self, q, k, v, gate, allowed, prompt, scaling, recent, memo=None):
        self.b, self.h, self.nq, self.d = q.shape
        self.hk, self.n = k.shape[1], k.shape[2]
        self.q = _in_place(q)
        # one dtype for the tiles: k and v enter as the queries do
        self.k = _in_place(k.to(q.dtype))
        self.v = _in_place(v.to(q.dtype))
        self.keep = (gate.detach() > 0.5).to(torch.int8).contiguous()
        self.keep_group = self.h // gate.shape[1]
        self.group = self.h // self.hk
        # one derivation per mask and forward (its run test reads back from the device)
        self.mode, self.lo, self.hi, self.dense = memoised(
            memo, ("triton mask vectors", self.nq, self.n),
            lambda: _mask_vectors(allowed, self.n, q.device))
        self.prompt = (prompt.to(torch.int8).contiguous() if prompt is not None
                       else torch.zeros(1, dtype=torch.int8, device=q.device))
        self.has_prompt = prompt is not None
        self.scale = float(scaling)
        self.offset = self.n - self.nq
        self.window = max(int(recent), 1)
        self.block_d = max(16, triton.next_power_of_2(self.d))
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def mask_args(self) -> tuple:
        return (self.lo.stride(0) if self.lo.dim() == 2 else 0,
                self.dense.stride(0) if self.dense.dim() == 3 else 0,
                self.dense.stride(1) if self.dense.dim() == 3 else 0,
                self.prompt.stride(0) if self.prompt.dim() == 2 else 0)

    def launch(self, which: str, rows: int):
        """The kernel ``which`` ready to call on a grid of ``rows`` (tiles of BLOCK_M if
        "M", else of BLOCK_N) x ``heads``, with its compile-time arguments."""
        kernel, tiles = _launcher(which, self.q.device)
        heads = self.b * (self.hk if which == "kv" else self.h)
        tile = "BLOCK_N" if which == "kv" else "BLOCK_M"

        def grid(meta):
            return (triton.cdiv(rows, meta[tile]), heads)

        consts = {"D": self.d, "BLOCK_D": self.block_d, "MASK_MODE": self.mode,
                  "HAS_PROMPT": self.has_prompt, "PRECISION": self.precision, **tiles}
        return kernel[grid], consts


def _forward_call(pb: _Problem) -> tuple[Tensor, Tensor]:
    # [B, H, nq, d] over [B, nq, H, d] memory: the layer's transpose back is a view
    out = torch.empty(pb.b, pb.nq, pb.h, pb.d, dtype=pb.q.dtype,
                      device=pb.q.device).transpose(1, 2)
    lse = torch.empty(pb.b, pb.h, pb.nq, dtype=torch.float32, device=pb.q.device)
    kernel, c = pb.launch("fwd", pb.nq)
    q, k, v = pb.q, pb.k, pb.v
    kernel(q, k, v, pb.keep, pb.lo, pb.hi, pb.dense, pb.prompt, out, lse,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
           pb.keep.stride(0), pb.keep.stride(1), lse.stride(0), lse.stride(1), *pb.mask_args(),
           pb.h, pb.nq, pb.n, pb.offset, pb.scale * LOG2E, pb.window, pb.group, pb.keep_group,
           **c)
    return out, lse


def _row_term(pb: _Problem, do: Tensor, out: Tensor) -> Tensor:
    """``D_j = dO_j . o_j`` [B, H, nq] in fp32, read from both in place."""
    delta = torch.empty(pb.b, pb.h, pb.nq, dtype=torch.float32, device=do.device)
    rows, warps = _ROW_TILE["cuda" if do.device.type == "cuda" else "interpreter"]
    grid = (triton.cdiv(pb.nq, rows), pb.b * pb.h)
    _row_dot[grid](do, out, delta, do.stride(0), do.stride(1), do.stride(2), out.stride(0),
                   out.stride(1), out.stride(2), delta.stride(0), delta.stride(1), pb.h, pb.nq,
                   D=pb.d, BLOCK_D=pb.block_d, BLOCK_M=rows, num_warps=warps)
    return delta


def _backward_call(pb: _Problem, out: Tensor, lse: Tensor, grad_out: Tensor):
    q, k, v = pb.q, pb.k, pb.v
    do = _in_place(grad_out.to(q.dtype))
    delta = _row_term(pb, do, out)
    # empty_like keeps a dense tensor's strides: each gradient in its input's layout, so the
    # autograd ops behind the kernel (the layer's transpose and reshape) need no copy
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    per_query_head = pb.keep_group == 1 and pb.group > 1
    dg = torch.empty(pb.b, pb.keep.shape[1], pb.n, dtype=torch.float32, device=q.device)
    common = (pb.keep.stride(0), pb.keep.stride(1), lse.stride(0), lse.stride(1))
    kernel, c = pb.launch("kv", pb.n)
    kernel(q, k, v, pb.keep, pb.lo, pb.hi, pb.dense, pb.prompt, do, lse, delta, dk, dv, dg,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
           *common, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1),
           dv.stride(2), dg.stride(0), dg.stride(1), *pb.mask_args(),
           pb.hk, pb.nq, pb.n, pb.offset, pb.scale, pb.scale * LOG2E, _CLAMP2, pb.window,
           pb.group, pb.keep_group, KEEP_PER_QUERY_HEAD=per_query_head, **c)
    kernel, c = pb.launch("q", pb.nq)
    kernel(q, k, v, pb.keep, pb.lo, pb.hi, pb.dense, pb.prompt, do, lse, delta, dq,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
           *common, dq.stride(0), dq.stride(1), dq.stride(2), *pb.mask_args(),
           pb.h, pb.nq, pb.n, pb.offset, pb.scale, pb.scale * LOG2E, pb.window, pb.group,
           pb.keep_group, **c)
    return dq, dk, dv, dg


class _TritonGatedAttention(torch.autograd.Function):
    """Forward kernel without autograd; backward from the saved row statistics (O(n))."""

    @staticmethod
    def forward(ctx, q, k, v, gate, problem):
        out, lse = _forward_call(problem)
        ctx.problem = problem
        ctx.save_for_backward(out, lse)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, gate.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out, lse = ctx.saved_tensors
        pb = ctx.problem
        dq, dk, dv, dg = _backward_call(pb, out, lse, grad_out)
        qt, kt, vt, gt = ctx.dtypes
        return dq.to(qt), dk.to(kt), dv.to(vt), dg.to(gt), None


def triton_gated_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor,
                           allowed: Tensor | None = None, scaling: float | None = None,
                           recent: int = 0, prompt: Tensor | None = None,
                           memo: dict | None = None) -> Tensor:
    """``kvgate.attention.gated.gated_attention`` on the Triton kernels (same arguments, already
    validated there; ``allowed`` bool [B, 1, n_q, n] or None; ``memo`` keeps the mask vectors
    for the next call with the same mask). Returns [B, H, n_q, d] in q's
    dtype; the tiles take q's dtype (fp32, bf16 or fp16), statistics stay fp32."""
    if triton is None:
        raise RuntimeError("the triton attention kernel needs the triton package "
                           "(pip install 'kvgate[triton]'); use kernel 'chunked'")
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the triton attention kernel runs on CUDA (on {q.device.type} only "
                           f"under TRITON_INTERPRET=1, for tests); use kernel 'chunked'")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise RuntimeError(f"the triton attention kernel takes fp32, bf16 or fp16, not {q.dtype}")
    scaling = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)
    problem = _Problem(q.detach(), k.detach(), v.detach(), gate, allowed, prompt, scaling,
                       recent, memo)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, gate)):
        return _TritonGatedAttention.apply(q, k, v, gate, problem)
    return _forward_call(problem)[0]
