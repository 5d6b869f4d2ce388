"""What the cache reads off transformers' attention mask, and eq. 5 masked prefill attention."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from kvgate.cache.errors import CacheError

# Row chunk of the eq. 5 attention: bounds the [B, H, rows, n] mask SDPA materialises.
_MASK_ELEMS = 1 << 26


def _as_bool(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    # additive float masks: 0 where visible, a very negative number where hidden
    return mask > torch.finfo(mask.dtype).min / 2


def new_token_validity(mask: Tensor | None, batch: int, rows: int, device) -> Tensor:
    """Which of the ``rows`` new tokens are real (not padding): ``[B, rows]`` bool.

    The new tokens are the last ``rows`` key columns of the mask, so a real token is one that
    sees itself (the diagonal); this holds for causal, padded and sliding-window masks alike.
    """
    if mask is None:
        return torch.ones(batch, rows, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # a raw [B, kv] padding mask
        return _as_bool(mask[:, -rows:]).expand(batch, rows).to(device)
    if mask.dim() != 4 or mask.shape[-2] != rows or mask.shape[-1] < rows:
        raise CacheError(f"attention mask of shape {tuple(mask.shape)} does not fit {rows} new "
                         "tokens; CompressedCache expects transformers' 4-D [B, 1, q, kv] mask")
    j = torch.arange(rows, device=mask.device)
    diag = mask[:, 0, j, mask.shape[-1] - rows + j]
    return _as_bool(diag).expand(batch, rows).to(device)


def positions_after(valid: Tensor, start: Tensor) -> Tensor:
    """True positions of new tokens: ``start`` [B] + running count of real tokens, -1 at pads."""
    pos = start[:, None] + valid.long().cumsum(-1) - 1
    return pos.masked_fill(~valid, -1)


def prompt_allowed(mask: Tensor | None, batch: int, n: int, window: int | None,
                   device) -> Tensor:
    """``[B, n, n]`` bool: which key each prompt row may see before any eviction.

    Taken from the model's mask when there is one (causal + padding + sliding window);
    rebuilt as causal (+ window) when transformers skipped the mask.
    """
    if mask is not None:
        if mask.dim() != 4 or mask.shape[-2:] != (n, n):
            raise CacheError(f"prefill attention mask of shape {tuple(mask.shape)} is not "
                             f"[B, 1, {n}, {n}]")
        return _as_bool(mask[:, 0]).expand(batch, n, n)
    qi = torch.arange(n, device=device)[:, None]
    ki = torch.arange(n, device=device)[None, :]
    allowed = ki <= qi
    if window:
        allowed = allowed & (ki > qi - window)
    return allowed[None].expand(batch, n, n)


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
