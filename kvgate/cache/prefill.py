"""Eq. 5 masked prefill attention (the mask readers it uses live in ``kvgate.attention.masks``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from kvgate.attention.masks import new_token_validity, positions_after, prompt_allowed

__all__ = ["keep_masked_attention", "new_token_validity", "positions_after", "prompt_allowed"]

# Row chunk of the eq. 5 attention: bounds the [B, H, rows, n] mask SDPA materialises.
_MASK_ELEMS = 1 << 26


def keep_masked_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor,
                          keep: Tensor, scaling: float, recent: int = 0) -> Tensor:
    """Prefill attention under the Attention-Gate mask (paper eq. 5).

    Query ``j`` sees key ``t`` iff ``allowed[b, j, t]`` and (``keep[b, h, t]`` or
    ``j - t < max(recent, 1)``: the diagonal, plus an optional always-visible recent band).
    query [B, H, n, d], key/value [B, H_kv, n, d], allowed [B, n, n], keep [B, H_kv, n]
    (one flag per KV head, shared by its query heads). Returns [B, n, H, d].
    """
    b, h, n, d = query.shape
    hk = key.shape[1]
    g = h // hk
    q5 = query.view(b, hk, g, n, d)
    k5 = key[:, :, None].expand(b, hk, g, n, d)
    v5 = value[:, :, None].expand(b, hk, g, n, value.shape[-1])
    ki = torch.arange(n, device=query.device)
    out = []
    step = max(1, _MASK_ELEMS // max(1, b * h * n))
    for lo in range(0, n, step):  # row chunks bound the mask's memory, not a per-token loop
        hi = min(n, lo + step)
        qi = ki[lo:hi, None]
        band = (qi - ki[None, :] < max(recent, 1))[None, None]
        vis = allowed[:, None, lo:hi] & (keep[:, :, None, :] | band)  # [B, H_kv, r, n]
        vis = vis[:, :, None].expand(b, hk, g, hi - lo, n)
        out.append(scaled_dot_product_attention(q5[:, :, :, lo:hi], k5, v5, attn_mask=vis,
                                                scale=scaling))
    o = out[0] if len(out) == 1 else torch.cat(out, dim=3)
    return o.reshape(b, h, n, -1).transpose(1, 2)
