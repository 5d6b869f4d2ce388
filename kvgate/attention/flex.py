"""Gated attention on FlexAttention: block-sparse, with no n x n tensor in forward or backward.

Same contract and rules as ``kvgate.attention.gated`` (read its docstring for the masks and the
closed-form gate gradient). The difference is how the work is done, for CUDA:

- forward: one ``flex_attention`` call whose ``mask_mod`` reads the keep flags, the base mask
  and the recent band per element, so blocks above the diagonal are skipped and no bias is
  materialised (the memory-efficient kernel of the chunked path takes a dense [B, H, n, n]
  fp32 bias: 2 GiB at 32 heads x 4,096 tokens);
- backward: FlexAttention's own fused backward gives dq, dk, dv; the gate gradient

      dL/dg_t = sum_j P~_jt (dO_j . v_t - D_j)  over the gated region of column t

  is one more *forward* call with the roles swapped: keys are the queries, queries the keys,
  a ``score_mod`` subtracts the forward's lse_j, and the values are [dO_j, D_j]. That call
  returns the softmax-normalised sum and its lse; times exp(lse) it is the plain sum
  sum_j P~_jt [dO_j, D_j], from which dg_t = v_t . A_t - B_t. So the gate gradient costs one
  block-sparse attention forward, not a Python loop of chunks.

FlexAttention has no backward on the CPU, so training through this kernel needs CUDA; its
forward (and the gate gradient, a forward) runs anywhere, which is how the CPU tests check it.
Its CUDA checks (the four gradients against the chunked kernel, a model's training step) are
in tests/gpu, its timings in ``bench/gpu_checks.sh run OUT flex``. On an H200 (torch 2.11) the
kernel tests pass, but forward + backward took 12.6 ms against the chunked kernel's 3.4 ms at
9 heads x 2,048 and 390 ms against 28 ms at 32 x 4,096 (fp32 q/k/v, ~55 s of compilation per
process), so ``GateConfig.kernel`` "auto" does not pick it. Suspects, untested: fp32 tiles at
head width 128 and the gate-gradient pass's value width of 2d (256).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kvgate.attention.common import EXP_CLAMP, keep_per_query_head

try:  # FlexAttention arrived in torch 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - the pinned torch has it
    flex_attention = None
try:  # torch >= 2.9 returns the log-sum-exp through return_aux; return_lse is deprecated
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

BLOCK = 128  # FlexAttention's default tile: blocks wholly above the diagonal are skipped


def flex_available() -> bool:
    return flex_attention is not None


@functools.cache
def _compiled():
    # eager flex_attention materialises the scores (a reference implementation); the fused
    # kernel is what torch.compile generates from it. Default dynamism: a second sequence
    # length recompiles once with dynamic shapes instead of once per length (SFT batches vary)
    return torch.compile(flex_attention)


def _flex_fn(device: torch.device):
    return _compiled() if device.type == "cuda" else flex_attention


def _attend(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """(out, natural-log lse) of one flex_attention call (compiled on CUDA)."""
    fn = _flex_fn(q.device)
    if AuxRequest is None:
        return fn(q, k, v, return_lse=True, **kwargs)
    out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def _mask_mods(allowed: Tensor | None, keep: Tensor, prompt: Tensor | None, offset: int,
               recent: int):
    """(visible, gated_transposed) mask_mods over query rows ``qi`` (positions offset + qi)
    and key positions ``ki``: visible is what the forward's softmax sees; gated_transposed,
    indexed (key, query), is where the gate's gradient is collected (the gate decides there)."""
    window = max(recent, 1)

    def rules(b, qi, ki):
        qp = qi + offset
        causal = ki <= qp
        base = causal if allowed is None else causal & allowed[b, 0, qi, ki]
        base = base | (ki == qp)  # never an empty row, also for padding queries
        ungated = causal & (qp - ki < window)
        if prompt is not None:
            ungated = ungated | prompt[b, qp] | ~prompt[b, ki]
        return base, ungated

    def visible(b, h, qi, ki):
        base, ungated = rules(b, qi, ki)
        return base & (ungated | keep[b, h, ki])

    def gated_transposed(b, h, ki, qi):
        base, ungated = rules(b, qi, ki)
        return base & ~ungated

    return visible, gated_transposed


def _block_mask(mask_mod, b: int, h: int, rows: int, cols: int, device: torch.device):
    # compiled on CUDA so that the mask is evaluated block by block, never as [B, H, n, n]
    return create_block_mask(mask_mod, b, h, rows, cols, device=device, BLOCK_SIZE=BLOCK,
                             _compile=device.type == "cuda")


def _gate_gradient(q: Tensor, kr: Tensor, vr: Tensor, out: Tensor, lse: Tensor,
                   grad_out: Tensor, block: object, scaling: float) -> Tensor:
    """dL/dg [B, H, n] (per query head) as one transposed attention forward (module docstring).

    q, out, grad_out [B, H, nq, d]; kr, vr [B, H, n, d] (repeated to the query heads); lse
    [B, H, nq]; ``block`` the transposed block mask ([n] rows over [nq] columns)."""
    d = q.shape[-1]
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True).to(out.dtype)  # D_j = dO_j . o_j
    # [dO_j, D_j] zero-padded to a power of two: older Triton templates of flex_attention take
    # no other value width, and newer ones round it up to one internally anyway
    width = 1 << d.bit_length()
    values = torch.cat([grad_out, delta, grad_out.new_zeros(*delta.shape[:-1], width - d - 1)], -1)

    def minus_lse(score, b, h, ki, qi):
        # P~_jt = exp(s_jt - lse_j), clamped as in the chunked kernel
        return torch.clamp(score - lse[b, h, qi], max=EXP_CLAMP)

    summed, lse_t = _attend(kr, q, values, score_mod=minus_lse, block_mask=block, scale=scaling)
    # a key no query is gated on has an empty row: its sum is 0 (lse -inf)
    scale = torch.where(torch.isfinite(lse_t), torch.exp(lse_t), torch.zeros_like(lse_t))
    summed = torch.nan_to_num(summed.float()) * scale[..., None]
    return (summed[..., :d] * vr.float()).sum(-1) - summed[..., d]


class _GateGradient(torch.autograd.Function):
    """Identity on the attention output; its backward adds the gate's closed-form gradient.

    dq, dk, dv flow through ``out`` into FlexAttention's own backward; this node only
    contributes dL/dgate, from the saved forward statistics."""

    @staticmethod
    def forward(ctx, out, gate, q, kr, vr, lse, scaling, block):
        ctx.save_for_backward(q, kr, vr, out, lse)
        ctx.scaling, ctx.block, ctx.gate_heads = scaling, block, gate.shape[1]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        q, kr, vr, out, lse = ctx.saved_tensors
        dgate = _gate_gradient(q, kr, vr, out, lse, grad_out.to(out.dtype), ctx.block,
                               ctx.scaling)
        b, h, n = dgate.shape
        if ctx.gate_heads != h:  # a flag per KV head: sum over the query heads sharing it
            dgate = dgate.view(b, ctx.gate_heads, h // ctx.gate_heads, n).sum(2)
        return grad_out, dgate, None, None, None, None, None, None


def flex_gated_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor,
                         allowed: Tensor | None = None, scaling: float | None = None,
                         recent: int = 0, prompt: Tensor | None = None,
                         compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """``kvgate.attention.gated.gated_attention`` on FlexAttention (same arguments, already
    validated there; ``allowed`` bool [B, 1, n_q, n]). Softmax and accumulation in fp32;
    ``compute_dtype`` is the dtype q, k, v (and the gate pass's values) enter the kernel in:
    fp32 as the chunked kernel, or bf16, for ``bench/bench_kernel.py`` to time the kernel's
    half-precision tiles against it (the gate gradient's last combination stays in fp32)."""
    if not flex_available():
        raise RuntimeError("the flex attention kernel needs torch >= 2.5 (FlexAttention)")
    b, h, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    grad = torch.is_grad_enabled()
    if grad and q.device.type != "cuda" and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("the flex attention kernel trains only on CUDA (FlexAttention has "
                           "no backward on the CPU); use kernel 'chunked' here")
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    keep = keep_per_query_head(gate, h)[:, :, 0]  # [B, H, n] bool
    visible, gated_transposed = _mask_mods(allowed, keep, prompt, n - nq, int(recent))
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    block = _block_mask(visible, b, h, nq, n, q.device)
    out, lse = _attend(qf, kf, vf, block_mask=block, scale=scaling, enable_gqa=hk != h)
    if grad and gate.requires_grad:
        kr = kf.detach().repeat_interleave(h // hk, 1)
        vr = vf.detach().repeat_interleave(h // hk, 1)
        transposed = _block_mask(gated_transposed, b, h, n, nq, q.device)
        out = _GateGradient.apply(out, gate, qf.detach(), kr, vr, lse.detach(), scaling,
                                  transposed)
    return out.to(q.dtype)
