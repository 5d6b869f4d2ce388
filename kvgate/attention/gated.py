"""Gated attention (Attention-Gate paper, eq. 5) with a gradient that reaches evicted tokens.

Query j sees key t iff the base mask allows it (causal, padding, sliding window) and
(t is within the last ``recent`` keys of j, the diagonal included, or keep[t]).

A plain -inf mask would give the gate of an evicted token no gradient, so it could never come
back. The multiplicative gated softmax ``p_jt = g_t e_jt / sum_u g_u e_ju`` equals the masked
softmax in the forward pass and has the closed-form gate gradient

    dL/dg_t = sum_j  P~_jt (dO_j . v_t - dO_j . o_j),   P~_jt = exp(s_jt - lse_j)

(summed over the query heads that share the gate), where lse_j is the masked forward's row
statistic and P~ is evaluated for every key the base mask allows, kept or not. So the forward
runs a masked softmax in row chunks and keeps only O(n) statistics; the backward recomputes each
chunk's scores once and produces dq, dk, dv and dg together: no n x n tensor is kept for backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Evicted keys that outscore every kept key would make P~ = exp(s - lse) explode; the clamp
# bounds their gradient (1 / e^-10 ~ 2e4 times a kept entry's) while leaving forward exact.
EXP_CLAMP = 10.0
DEFAULT_CHUNK = 256


def _chunk_masks(allowed: Tensor | None, rows: slice, n: int, recent: int, device) -> tuple[Tensor, Tensor]:
    """For query rows ``rows``: (base [B?,1,r,n] allowed, ungated [1,1,r,n] always-visible)."""
    qi = torch.arange(n, device=device)[rows][:, None]
    ki = torch.arange(n, device=device)[None, :]
    causal = ki <= qi
    base = causal[None, None] if allowed is None else (allowed[:, :, rows] & causal)
    ungated = (qi - ki < max(recent, 1)) & causal  # diagonal (+ recent window) bypasses the gate
    base = base | (ki == qi)  # never an empty row, also for padding queries
    return base, ungated[None, None]


def _expand_gate(gate: Tensor, hk: int, g: int) -> Tensor:
    """gate [B, Hg, n] with Hg in {Hk, Hk*G} -> [B, Hk, G|1, 1, n]."""
    b, hg, n = gate.shape
    if hg == hk:
        return gate.view(b, hk, 1, 1, n)
    return gate.view(b, hk, g, 1, n)


class _GatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, allowed, scaling, recent, chunk):
        b, h, n, d = q.shape
        hk = k.shape[1]
        g = h // hk
        q5 = q.view(b, hk, g, n, d)
        k5, v5 = k[:, :, None], v[:, :, None]
        keep = _expand_gate(gate.detach() > 0.5, hk, g)
        out = torch.empty(b, hk, g, n, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hk, g, n, dtype=torch.float32, device=q.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            base, ungated = _chunk_masks(allowed, rows, n, recent, q.device)
            vis = base[:, :, None] & (ungated[:, :, None] | keep)
            s = torch.matmul(q5[:, :, :, rows].float(), k5.float().transpose(-1, -2)) * scaling
            s = s.masked_fill(~vis, -math.inf)
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            z = p.sum(-1, keepdim=True)
            out[:, :, :, rows] = torch.matmul(p, v5.float()) / z
            lse[:, :, :, rows] = (m + torch.log(z)).squeeze(-1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, gate, allowed, out, lse)
        ctx.scaling, ctx.recent, ctx.chunk = scaling, recent, chunk
        return out.view(b, h, n, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, gate, allowed, out, lse = ctx.saved_tensors
        scaling, recent, chunk = ctx.scaling, ctx.recent, ctx.chunk
        b, h, n, d = q.shape
        hk = k.shape[1]
        g = h // hk
        dv_ = v.shape[-1]
        q5 = q.view(b, hk, g, n, d).float()
        k5, v5 = k[:, :, None].float(), v[:, :, None].float()
        do = grad_out.reshape(b, hk, g, n, dv_).float()
        o = out.view(b, hk, g, n, dv_).float()
        keep = _expand_gate(gate.detach() > 0.5, hk, g)
        delta = (do * o).sum(-1, keepdim=True)  # D_j = dO_j . o_j
        dq = torch.zeros_like(q5)
        dk = torch.zeros(b, hk, g, n, d, dtype=torch.float32, device=q.device)
        dvv = torch.zeros(b, hk, g, n, dv_, dtype=torch.float32, device=q.device)
        dgate = torch.zeros(b, hk, g, n, dtype=torch.float32, device=q.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            base, ungated = _chunk_masks(allowed, rows, n, recent, q.device)
            base, ungated = base[:, :, None], ungated[:, :, None]
            s = torch.matmul(q5[:, :, :, rows], k5.transpose(-1, -2)) * scaling
            # P~ for every key the base mask allows (kept or evicted), exponent clamped
            pt = torch.exp(torch.clamp(s - lse[:, :, :, rows, None], max=EXP_CLAMP))
            pt = pt.masked_fill(~base, 0.0)
            p = pt * (ungated | keep)  # the forward's probabilities
            dp = torch.matmul(do[:, :, :, rows], v5.transpose(-1, -2))
            resid = dp - delta[:, :, :, rows]
            ds = p * resid
            dq[:, :, :, rows] = torch.matmul(ds, k5) * scaling
            dk += torch.matmul(ds.transpose(-1, -2), q5[:, :, :, rows]) * scaling
            dvv += torch.matmul(p.transpose(-1, -2), do[:, :, :, rows])
            dgate += (pt * resid).masked_fill(ungated, 0.0).sum(-2)
        dk = dk.sum(2).to(k.dtype)
        dvv = dvv.sum(2).to(v.dtype)
        dgate = dgate.sum(2) if gate.shape[1] == hk else dgate.reshape(b, h, n)
        return (dq.reshape(b, h, n, d).to(q.dtype), dk, dvv, dgate.to(gate.dtype),
                None, None, None, None)


def gated_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, allowed: Tensor | None = None,
                    scaling: float | None = None, recent: int = 0,
                    chunk: int = DEFAULT_CHUNK) -> Tensor:
    """Attention where evicted keys (gate 0) are hidden from every later query.

    q [B, H, n, d]; k, v [B, H_kv, n, d]; gate [B, H_kv, n] (one flag per KV head, broadcast to
    its query heads) or [B, H, n] (per query head), forward values exactly 0/1 (a straight-
    through value carries its gradient); allowed [B, 1|H, n, n] bool base mask (True = may
    attend; causal/padding/window) or None for plain causal; recent: keys within the last
    ``recent`` positions of each query bypass the gate (the diagonal always does).
    Returns [B, H, n, d] in q's dtype. Softmax and accumulation run in fp32.
    """
    b, h, n, d = q.shape
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"query heads {h} not a multiple of kv heads {k.shape[1]}")
    if gate.shape not in ((b, k.shape[1], n), (b, h, n)):
        raise ValueError(f"gate shape {tuple(gate.shape)} must be [B, H_kv|H, n] = "
                         f"[{b}, {k.shape[1]}|{h}, {n}]")
    if allowed is not None:
        if allowed.dtype != torch.bool:
            allowed = allowed > -1e4  # additive float mask -> bool
        if allowed.shape[1] != 1:
            raise ValueError("per-head base masks are not supported; pass [B, 1, n, n]")
        allowed = allowed[..., -n:].expand(b, 1, n, n)
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    return _GatedAttention.apply(q, k, v, gate, allowed, float(scaling), int(recent), int(chunk))


def gated_attention_reference(q: Tensor, k: Tensor, v: Tensor, gate: Tensor,
                              allowed: Tensor | None = None, scaling: float | None = None,
                              recent: int = 0) -> Tensor:
    """Materialised multiplicative gated softmax (the spec's formula); slow, for tests.

    Differentiable in a *continuous* gate too, which is what finite-difference checks need.
    """
    b, h, n, d = q.shape
    hk = k.shape[1]
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    kk = k.repeat_interleave(h // hk, 1).float()
    vv = v.repeat_interleave(h // hk, 1).float()
    gq = gate.repeat_interleave(h // hk, 1) if gate.shape[1] == hk else gate
    base, ungated = _chunk_masks(None if allowed is None else allowed.expand(b, 1, n, n),
                                 slice(0, n), n, recent, q.device)
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scaling
    gm = torch.where(ungated, torch.ones_like(s), gq.float()[:, :, None, :].expand_as(s))
    gm = gm * base
    m = s.masked_fill(gm.detach() <= 0, -math.inf).amax(-1, keepdim=True).detach()
    e = torch.exp(torch.clamp(s - m, max=EXP_CLAMP))
    w = gm * e
    p = w / w.sum(-1, keepdim=True)
    return torch.matmul(p, vv).to(q.dtype)
