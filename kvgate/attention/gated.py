"""Gated attention (Attention-Gate paper, eq. 5) with a gradient that reaches evicted tokens.

Query j sees key t iff the base mask allows it (causal, padding, sliding window) and
(t is within the last ``recent`` keys of j, the diagonal included, or keep[t]).

With a ``prompt`` mask (one-shot use: the prompt is encoded with full attention and compressed
afterwards, as the heuristics do) the gate applies only where a token after the prompt reads a
prompt token: prompt rows see every earlier token, and tokens after the prompt are never evicted.

Queries may be only the last rows of the sequence (``q`` shorter than ``k``: a continuation
reading an encoded prefix's K/V, as one-shot training's second pass does); they compute exactly
those rows of the full problem.

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

import importlib.util
import math

import torch
from torch import Tensor

from kvgate.attention.common import EXP_CLAMP, keep_per_query_head
from kvgate.attention.kernels import check_kernel

# Forward bias of a key the gate evicted: exp(EVICTED + s - max) is exactly 0 in fp32, as with
# -inf, but EVICTED * 0 is 0 where -inf * 0 would be NaN.
EVICTED = -1e30


def choose_kernel(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a gate config's ``kernel`` names for inputs of ``dtype`` on ``device``.

    "auto" is the Triton kernel for bf16 / fp16 inputs on CUDA where triton is installed (it
    ships with CUDA builds of torch): its tiles run on tensor cores, and on an H100 a gates-only
    training step on the Llama-2-7B layer shape ran 2.2x / 3.9x the materialised kernel's speed
    at 2,048 / 4,096 tokens (docs/RESULTS.md, speed and memory). fp32 inputs get the chunked
    kernel: the Triton tiles multiply fp32 exactly (no tensor cores), which on an H200 ran 21x
    slower than the materialised kernel's cuBLAS at 4,096 tokens. Everywhere else the chunked
    kernel."""
    if name != "auto":
        return name
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and importlib.util.find_spec("triton") is not None):
        return "triton"
    return "chunked"


def _chunk_masks(allowed: Tensor | None, rows: slice, offset: int, recent: int, device,
                 prompt: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """For query rows ``rows`` (positions ``offset + rows`` of the sequence) over the keys they
    can reach causally (0 .. offset + rows.stop): (base [B|1, 1, r, c] allowed, ungated
    [1|B, 1, r, c] always-visible: diagonal + recent, and with ``prompt`` [B, n_keys] the
    prompt's own rows and every key after the prompt)."""
    cols = offset + rows.stop
    qi = torch.arange(offset + rows.start, cols, device=device)[:, None]
    ki = torch.arange(cols, device=device)[None, :]
    causal = ki <= qi
    base = causal[None, None] if allowed is None else (allowed[:, :, rows, :cols] & causal)
    ungated = (qi - ki < max(recent, 1)) & causal
    base = base | (ki == qi)  # never an empty row, also for padding queries
    ungated = ungated[None, None]
    if prompt is not None:
        at = slice(offset + rows.start, cols)
        ungated = ungated | (prompt[:, None, at, None] | ~prompt[:, None, None, :cols])
    return base, ungated


def _rows_per_chunk(h: int, n: int, chunk: int | None, device: torch.device) -> int:
    # on the CPU, 64 rows skip most of the causally unreachable upper triangle at little cost
    # in matmul efficiency (a 1 x 512 layer runs ~1.8x faster than in one chunk), and long
    # sequences cap each [B, H, rows, n] fp32 temporary at ~16 MB per batch element. On a GPU
    # each chunk is a round of ~20 kernel launches that Python issues slower than the GPU runs
    # them: at SmolLM2's 9 heads x 2,048 tokens the 16 MB cap's 227-row chunks took 8.4 ms
    # where one chunk took 3.6 (bench/bench_kernel.py on an H100), so there the cap is 256 MB
    # and never under 256 rows (Llama-2-7B's 32 heads x 2,048: 1,024-row chunks).
    if device.type == "cpu":
        cap, budget, floor = 64, 4 << 20, 16
    else:
        cap, budget, floor = n, 64 << 20, 256
    return chunk or min(n, max(floor, min(cap, budget // max(1, h * n))))


def _bias(base: Tensor, ungated: Tensor, keep: Tensor) -> Tensor:
    """Additive mask [B, H, r, c] from the chunk masks and keep [B, H, 1, c], in one broadcast
    op: -inf where the base mask forbids, EVICTED where only the gate hides the key, else 0."""
    bias = torch.zeros(base.shape, device=base.device).masked_fill_(~base, -math.inf)
    return torch.addcmul(bias, (~keep).float(), (base & ~ungated).float(), value=EVICTED)


def _aligned(bias: Tensor) -> Tensor:
    """``bias`` as a view whose rows start on 16-element boundaries, as the CUDA
    memory-efficient kernel requires of an attention bias (same values)."""
    n = bias.shape[-1]
    if n % 16 == 0 and bias.is_contiguous():
        return bias
    padded = bias.new_empty(*bias.shape[:-1], n + (-n % 16))
    padded[..., :n] = bias
    return padded[..., :n]


def _masked_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scaling: float):
    """Masked softmax attention returning (out, row log-sum-exp) for the backward."""
    if q.device.type == "cpu":
        # the CPU flash kernel returns the log-sum-exp without an n x n probability tensor
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scaling)
    if q.device.type == "cuda":
        # CUDA's flash kernel takes no mask; the memory-efficient one takes an additive bias
        # and returns the log-sum-exp (padded to a multiple of 32 rows)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _aligned(bias.expand(q.shape[0], q.shape[1], -1, -1)), True, 0.0, False,
            scale=scaling)
        return out, lse[..., : q.shape[-2]]
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).add_(bias)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _chunked_forward(q: Tensor, kr: Tensor, vr: Tensor, keep: Tensor, allowed: Tensor | None,
                     prompt: Tensor | None, scaling: float, recent: int, step: int):
    """(out, lse) of the gated attention, ``step`` query rows at a time over only the keys they
    can reach: a fused kernel under an arbitrary mask computes every block, the unreachable
    upper triangle included, and a chunk's bias is all the n x n state there is."""
    nq, n = q.shape[2], kr.shape[2]
    offset = n - nq
    outs, lses = [], []
    for start in range(0, nq, step):
        rows = slice(start, min(start + step, nq))
        cols = offset + rows.stop
        base, ungated = _chunk_masks(allowed, rows, offset, recent, q.device, prompt)
        out, lse = _masked_forward(q[:, :, rows], kr[:, :, :cols], vr[:, :, :cols],
                                   _bias(base, ungated, keep[..., :cols]), scaling)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


class _GatedAttention(torch.autograd.Function):
    """Masked attention whose backward is one chunked pass giving dq, dk, dv and the gate's
    gradient together. The forward is the fused kernel run without autograd (its own
    backward would recompute the scores a second time), and only O(n) row statistics, the
    inputs and the output are kept: neither the n x n bias nor any probability matrix."""

    @staticmethod
    def forward(ctx, q, kr, vr, gate, keep, allowed, prompt, scaling, recent, steps):
        out, lse = _chunked_forward(q, kr, vr, keep, allowed, prompt, scaling, recent, steps[0])
        ctx.save_for_backward(q, kr, vr, gate, keep, out, lse, allowed, prompt)
        ctx.scaling, ctx.recent, ctx.step = scaling, recent, steps[1]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kr, vr, gate, keep, out, lse, allowed, prompt = ctx.saved_tensors
        b, h, nq, _ = q.shape
        n = kr.shape[2]
        offset = n - nq  # the queries are the last nq positions
        scaling = ctx.scaling
        do = grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)  # D_j = dO_j . o_j
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
        dgate = torch.zeros(b, h, n, dtype=torch.float32, device=q.device)
        # every n x n step below is a product with a 0/1 float mask or an in-place update:
        # masked_fill and bool-mask arithmetic on [B, H, r, c] cost several times a multiply on
        # the CPU, and the softmax scale goes on the O(n d) operands instead of the scores
        qs = q * scaling
        keep = keep.to(q.dtype)
        step = ctx.step
        for start in range(0, nq, step):
            rows = slice(start, min(start + step, nq))
            base, ungated = _chunk_masks(allowed, rows, offset, ctx.recent, q.device, prompt)
            gated = (base & ~ungated).to(q.dtype)  # [B|1, 1, r, c] keys the gate decides on
            open_ = (base & ungated).to(q.dtype)  # keys every query sees (diagonal, recent)
            # keys after the last row of the chunk are never seen
            cols = slice(0, offset + rows.stop)
            s = torch.matmul(qs[:, :, rows], kr[:, :, cols].transpose(-1, -2))
            # P~ for every key the base mask allows, kept or evicted (exponent clamped); a
            # visible key has s <= lse, so the clamp never touches the true probabilities
            pt = s.sub_(lse[:, :, rows, None]).clamp_(max=EXP_CLAMP).exp_()
            resid = torch.matmul(do[:, :, rows], vr[:, :, cols].transpose(-1, -2))
            resid = resid.sub_(delta[:, :, rows])  # dO_j . v_t - D_j
            pg = pt * gated  # P~ over the gated region: the gate gradient's weights
            p = pt.mul_(open_).addcmul_(pg, keep[..., cols])  # the forward's probabilities
            dv[:, :, cols] += torch.matmul(p.transpose(-1, -2), do[:, :, rows])
            ds = p.mul_(resid)  # dS / scaling
            dq[:, :, rows] = torch.matmul(ds, kr[:, :, cols]).mul_(scaling)
            dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), qs[:, :, rows])
            dgate[..., cols] += pg.mul_(resid).sum(-2)
        hg = gate.shape[1]
        if hg != h:
            dgate = dgate.view(b, hg, h // hg, n).sum(2)
        return dq, dk, dv, dgate.to(gate.dtype), None, None, None, None, None, None


def gated_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, allowed: Tensor | None = None,
                    scaling: float | None = None, recent: int = 0,
                    chunk: int | None = None, prompt: Tensor | None = None,
                    kernel: str = "auto", memo: dict | None = None) -> Tensor:
    """Attention where evicted keys (gate 0) are hidden from every later query.

    q [B, H, n_q, d] (the last n_q positions; n_q = n unless a prefix is already encoded);
    k, v [B, H_kv, n, d]; gate [B, H_kv, n] (one flag per KV head, broadcast to its query
    heads) or [B, H, n] (per query head), forward values exactly 0/1 (a straight-through value
    carries its gradient); allowed [B, 1|H, n_q, n] bool base mask (True = may attend;
    causal/padding/window) or None for plain causal; recent: keys within the last ``recent``
    positions of each query bypass the gate (the diagonal always does); prompt [B, n] bool or
    None: one-shot use (module docstring), the gate only hides prompt keys from the rows after
    the prompt; kernel: "chunked" (this module), "triton"
    (``kvgate.attention.triton_kernel``: FlashAttention-2-style tiles, CUDA) or "auto"
    (``choose_kernel``); memo: a dict that lives as long as ``allowed`` does (one forward of
    the model, ``kvgate.models.dispatch.ForwardContext.memo``), where a kernel keeps what it
    derives from the mask for the next layer (the Triton kernel's mask vectors: a device sync).
    Returns [B, H, n_q, d] in q's dtype. Softmax and accumulation run in fp32.
    """
    check_kernel(kernel)
    b, h, nq, d = q.shape
    n = k.shape[2]
    if nq > n:
        raise ValueError(f"{nq} queries over {n} keys: queries must be the last rows of the keys")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"query heads {h} not a multiple of kv heads {k.shape[1]}")
    if gate.shape not in ((b, k.shape[1], n), (b, h, n)):
        raise ValueError(f"gate shape {tuple(gate.shape)} must be [B, H_kv|H, n] = "
                         f"[{b}, {k.shape[1]}|{h}, {n}]")
    if allowed is not None:
        if allowed.dtype != torch.bool:
            allowed = allowed > -1e4  # additive float mask -> bool
        if allowed.shape[1] != 1:
            raise ValueError("per-head base masks are not supported; pass [B, 1, n_q, n]")
        allowed = allowed[..., -nq:, -n:].expand(b, 1, nq, n)
    if prompt is not None and tuple(prompt.shape) != (b, n):
        raise ValueError(f"prompt shape {tuple(prompt.shape)} must be [B, n] = [{b}, {n}]")
    chosen = choose_kernel(kernel, q.device, q.dtype)
    if chosen == "triton":
        from kvgate.attention.triton_kernel import triton_gated_attention

        return triton_gated_attention(q, k, v, gate, allowed, scaling, int(recent), prompt,
                                      memo)
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    g = h // k.shape[1]
    kr = k.repeat_interleave(g, 1).float()
    vr = v.repeat_interleave(g, 1).float()
    keep = keep_per_query_head(gate, h)
    # rows per chunk of the forward and of the backward: on the CPU the forward runs in the
    # backward's chunks (see _chunked_forward); the CUDA kernel takes the whole problem at once
    step = _rows_per_chunk(h, n, chunk, q.device)
    steps = (step if q.device.type == "cpu" else nq, step)
    qf = q.float()
    if torch.is_grad_enabled() and (gate.requires_grad or qf.requires_grad
                                    or kr.requires_grad or vr.requires_grad):
        out = _GatedAttention.apply(qf, kr, vr, gate, keep, allowed, prompt, scaling,
                                    int(recent), steps)
    else:
        out, _ = _chunked_forward(qf, kr, vr, keep, allowed, prompt, scaling, int(recent),
                                  steps[0])
    return out.to(q.dtype)


def gated_attention_reference(q: Tensor, k: Tensor, v: Tensor, gate: Tensor,
                              allowed: Tensor | None = None, scaling: float | None = None,
                              recent: int = 0, prompt: Tensor | None = None) -> Tensor:
    """Materialised multiplicative gated softmax (eq. 5 of the Attention-Gate paper, gates as
    weights); slow, for tests.

    Differentiable in a *continuous* gate too, which is what finite-difference checks need.
    """
    b, h, n, d = q.shape
    hk = k.shape[1]
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    kk = k.repeat_interleave(h // hk, 1).float()
    vv = v.repeat_interleave(h // hk, 1).float()
    gq = gate.repeat_interleave(h // hk, 1) if gate.shape[1] == hk else gate
    base, ungated = _chunk_masks(None if allowed is None else allowed.expand(b, 1, n, n),
                                 slice(0, n), 0, recent, q.device, prompt)
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scaling
    gm = torch.where(ungated, torch.ones_like(s), gq.float()[:, :, None, :].expand_as(s))
    gm = gm * base
    m = s.masked_fill(gm.detach() <= 0, -math.inf).amax(-1, keepdim=True).detach()
    e = torch.exp(torch.clamp(s - m, max=EXP_CLAMP))
    w = gm * e
    p = w / w.sum(-1, keepdim=True)
    return torch.matmul(p, vv).to(q.dtype)
