"""Column sums of causal attention probabilities, the score H2O, TOVA, SnapKV, NaCl, AhaKV
and RoCo read, computed in row chunks so memory stays O(chunk x n) and no n x n matrix exists.

Three entries: ``attention_sums`` (a softmax per chunk, any padding, optional row weights and
logit scales), its fast path given the fused kernel's log-sum-exp (``exp(logit - lse)`` in
place), and ``attention_with_sums`` (the attention output and the sums from one pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

ROW_CHUNK_ELEMS = 1 << 24  # fp32 elements in one row-chunk of attention probabilities (64 MiB)
# Query rows per KV head in one chunk's matmul. The row count, not the memory cap, sets the
# speed: 128 rows of [B, H_kv] keep the chunk in cache where 64 MiB chunks spill to memory
# (column sums at 4k on SmolLM2's shape, one thread: 0.30 s a layer against 0.62 s).
QUERY_ROWS = 128


def attention_sums(query: Tensor, key: Tensor, valid: Tensor, scaling: float, first_row: int = 0,
                   *, row_weight: Tensor | None = None, logit_scale: Tensor | None = None,
                   squares: bool = False, lse: Tensor | None = None, group_mean: bool = False,
                   ) -> Tensor | tuple[Tensor, Tensor]:
    """Column sums of causal fp32 attention probabilities over query rows ``first_row..n-1``.

    query [B, H, n, d], key [B, H_kv, n, d], valid [B, n]. ``row_weight`` [B, n] multiplies
    each row (0 drops it); ``logit_scale`` [B] or [B, n] multiplies the scaled logits of each
    sample / row before the softmax (AhaKV's lambda'). Rows are processed in chunks so memory
    stays O(chunk * n). Returns [B, H, n] (and the sums of squared probabilities with
    ``squares=True``). Padding rows and columns contribute 0.

    ``lse`` [B, H, n]: each row's log-sum-exp of its causal logits, as the prefill's fused
    kernel returns it (``LayerPrompt.lse``; unpadded prompts). The probabilities are then
    ``exp(logit - lse)`` in place, without a softmax, a mask of the whole chunk or NaN repair;
    ignored with ``logit_scale`` (the logits change).

    ``group_mean``: each row's probabilities averaged over its GQA group before summing (and
    squaring), as RoCo accumulates them: ``[B, H_kv, n]``.
    """
    if lse is not None and logit_scale is None:
        return _sums_from_lse(query, key, valid, scaling, first_row, row_weight, squares, lse,
                              group_mean)
    cols = torch.arange(query.shape[2], device=query.device)

    def probs(s: Tensor, start: int, end: int) -> Tensor:
        s = s * scaling
        if logit_scale is not None:
            scale = logit_scale.float()
            scale = (scale[:, None, None, None, None] if scale.dim() == 1
                     else scale[:, None, None, start:end, None])
            s = s * scale
        allowed = (cols[None, :end] <= cols[start:end, None])[None] & valid[:, None, :end]
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~allowed[:, None, None], -math.inf),
                                           dim=-1), nan=0.0)
        if row_weight is not None:
            p = p * row_weight[:, None, None, start:end, None].to(p.dtype)
        return p

    total, total_sq = _chunked_sums(query.float(), key, first_row, squares, probs, group_mean)
    return (total, total_sq) if squares else total


def attention_with_sums(query: Tensor, key: Tensor, value: Tensor, scaling: float,
                        ) -> tuple[Tensor, Tensor]:
    """Causal softmax attention ``[B, H, n, dv]`` and its column sums ``[B, H, n]`` (what
    ``attention_sums`` gives) from one pass over row chunks: each chunk's rows are whole (every
    key up to the row), so the softmax is exact without online rescaling, and the same
    probabilities give the output and the sums. Unpadded prompts; K/V ``[B, H_kv, n, d]``.
    Costs about one fused attention plus the sums, instead of a fused attention and then a
    second q.k pass for the sums."""
    def probs(s: Tensor, start: int, end: int) -> Tensor:
        s[..., start:end].masked_fill_(_later(start, end, s.device), -math.inf)
        return torch.softmax(s, dim=-1)

    b, h, n, _ = query.shape
    out = query.new_empty(b, h, n, value.shape[-1], dtype=torch.float32)
    total, _ = _chunked_sums(query.float() * scaling, key, 0, False, probs,
                             values=value.float(), out=out)
    return out.to(query.dtype), total


def _later(start: int, end: int, device: torch.device) -> Tensor:
    """``[r, r]`` True above the diagonal: in a chunk of rows ``[start, end)``, the keys of the
    chunk's own block that come after each row (causal; earlier blocks are all visible)."""
    return torch.ones(end - start, end - start, dtype=torch.bool, device=device).triu_(1)


def _chunked_sums(query: Tensor, key: Tensor, first_row: int, squares: bool,
                  probs: Callable[[Tensor, int, int], Tensor], group_mean: bool = False,
                  values: Tensor | None = None, out: Tensor | None = None,
                  ) -> tuple[Tensor, Tensor | None]:
    """The row-chunk loop of ``attention_sums``: per chunk of rows ``[start, end)`` the logits
    ``q . k`` over keys ``[0, end)`` (causal: later keys are never computed; query heads folded
    into rows, so a KV head's keys serve its g heads unexpanded) as ``[B, H_kv, g, r, end]``,
    turned into probabilities by ``probs(s, start, end)`` and summed over the rows. With
    ``values`` [B, H_kv, n, dv], each chunk's ``probs @ values`` is written into ``out``
    [B, H, n, dv] too."""
    b, h, n, d = query.shape
    hk = key.shape[1]
    g = h // hk
    k = key.float()
    q5 = query.view(b, hk, g, n, d)
    step = max(1, min(-(-QUERY_ROWS // g), ROW_CHUNK_ELEMS // max(1, b * h * n)))
    heads = hk if group_mean else h
    total = query.new_zeros((b, heads, n), dtype=torch.float32)
    total_sq = query.new_zeros((b, heads, n), dtype=torch.float32) if squares else None
    for start in range(max(0, first_row), n, step):
        end = min(n, start + step)
        r = end - start
        q = q5[:, :, :, start:end].reshape(b, hk, g * r, d)
        p = probs(torch.matmul(q, k[:, :, :end].transpose(-1, -2)).view(b, hk, g, r, end),
                  start, end)
        if values is not None:
            o = torch.matmul(p.view(b, hk, g * r, end), values[:, :, :end])
            out.view(b, hk, g, n, -1)[:, :, :, start:end] = o.view(b, hk, g, r, -1)
        if group_mean:
            p = p.mean(2, keepdim=True)
        total[..., :end] += p.sum(3).view(b, heads, end)
        if total_sq is not None:
            total_sq[..., :end] += p.square().sum(3).view(b, heads, end)
    return total, total_sq


def _sums_from_lse(query: Tensor, key: Tensor, valid: Tensor, scaling: float, first_row: int,
                   row_weight: Tensor | None, squares: bool, lse: Tensor, group_mean: bool,
                   ) -> Tensor | tuple[Tensor, Tensor]:
    """``attention_sums`` given each row's log-sum-exp: per row chunk one matmul, one
    subtraction and one exponential in place; only the chunk's diagonal block is masked (the
    keys after each row), padding rows weigh 0 and padding columns are zeroed at the end."""
    b, _, n, _ = query.shape
    # a padding row's log-sum-exp set to +inf makes all its probabilities exp(-inf) = 0
    lse5 = lse.float().masked_fill(~valid[:, None, :], math.inf).view(b, key.shape[1], -1, n)

    def probs(p: Tensor, start: int, end: int) -> Tensor:
        p.sub_(lse5[:, :, :, start:end, None]).exp_()
        p[..., start:end].masked_fill_(_later(start, end, p.device), 0.0)
        if row_weight is not None:
            p.mul_(row_weight[:, None, None, start:end, None].to(p.dtype))
        return p

    total, total_sq = _chunked_sums(query.float() * scaling, key, first_row, squares, probs,
                                    group_mean)
    pad = ~valid[:, None, :]
    total.masked_fill_(pad, 0.0)
    if total_sq is not None:
        total_sq.masked_fill_(pad, 0.0)
    return (total, total_sq) if squares else total
