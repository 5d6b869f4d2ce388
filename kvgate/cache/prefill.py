"""Eq. 5 masked prefill attention (the mask readers it uses live in ``kvgate.attention.masks``).

Two exact implementations of the same visibility rule. The general one takes any ``allowed``
mask. The blocked one serves the common case (causal + left padding, no sliding window) at
about the cost of the full cache's causal prefill: per block of query rows, the kept keys old
enough to be visible to every row of the block are gathered into a dense prefix (no mask work
per row), and only the block's own window of ``rows + band`` keys is masked. With half the
keys evicted it multiplies about half the scores the full causal prefill does.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvgate.attention.masks import as_bool, new_token_validity, positions_after, prompt_allowed
from kvgate.policies.contract import LayerPrompt, Policy, prefill_band
from kvgate.policies.sums import attention_with_sums

__all__ = ["causal_attention_lse", "causal_attention_sums", "eq5_attention",
           "keep_masked_attention", "new_token_validity", "positions_after", "prompt_allowed",
           "prompt_attention"]

# Row chunk of the general path: bounds the [B, H, rows, n] mask SDPA materialises.
_MASK_ELEMS = 1 << 26
# Query rows per block of the blocked path: the masked window is rows + band keys wide, the
# dense prefix is shared by the block's rows (larger blocks: fewer calls, more masked work).
_BLOCK_ROWS = 256
# The blocked path's dense prefix is padded (masked) to a multiple of this many keys. Why: on a
# CPU with AMX, SDPA's fused kernel in bf16 / fp16 runs its matmuls as oneDNN brgemm kernels
# kept in a thread-local cache keyed by their shapes that is never emptied (ATen's
# CPUBlas.cpp, ``KernelCache``), tens of KB per distinct key length. The prefix length (kept
# keys before the block) differs per layer, block and example, so a RULER eval of a gate grew
# that cache by tens of MB per 4k example, GBs over 96 examples; padded, there are at most
# prompt / 64 lengths, and the kernel's key blocks (512 long) have at most 8 tail sizes.
_PREFIX_STEP = 64


def prompt_attention(policy: Policy, prompt: LayerPrompt, keep: Tensor, mask: Tensor | None,
                     window: int | None, **kwargs) -> Tensor:
    """The prompt's own attention once ``keep`` [B, H_kv, n] is chosen, as the cache's prefill
    and the masked evaluation both compute it: under the eq. 5 mask for a policy that encodes
    the prompt under its keep flags (``EncodeMasking``: later rows see only kept entries),
    else full SDPA (``kwargs``: transformers' attention arguments). [B, n, H, d]."""
    band = prefill_band(policy, prompt)
    if band is not None:
        return eq5_attention(prompt.query, prompt.key, prompt.value, mask, prompt.valid, keep,
                             prompt.scaling, band, window)
    out, _ = sdpa_attention_forward(prompt.module, prompt.query, prompt.key, prompt.value, mask,
                                    scaling=prompt.scaling, dropout=0.0, **kwargs)
    return out


def eq5_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                  valid: Tensor, keep: Tensor, scaling: float, recent: int,
                  window: int | None) -> Tensor:
    """Prefill attention under the gate's keep flags; picks the blocked path when it applies.

    ``mask`` is the model's 4-D prompt mask (or None), ``valid`` [B, n] the real tokens;
    returns [B, n, H, d] like ``keep_masked_attention``.
    """
    b, _, n, _ = query.shape
    if window is None and (mask is None or _is_causal_padding(mask, valid)):
        return keep_masked_attention(query, key, value, None, keep, scaling, recent,
                                     valid=valid)
    allowed = prompt_allowed(mask, b, n, window, query.device)
    return keep_masked_attention(query, key, value, allowed, keep, scaling, recent)


def causal_attention_lse(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                         valid: Tensor, scaling: float, window: int | None,
                         ) -> tuple[Tensor, Tensor] | None:
    """The full cache's causal prefill attention and its per-row log-sum-exp, from SDPA's fused
    CPU kernel (the output is the one transformers' SDPA path computes, bit for bit): ``(out
    [B, n, H, d], lse [B, H, n])``. None where that kernel does not apply (another device, a
    sliding window, padding, a mask that is not plain causal); the caller then attends as
    usual and goes without the log-sum-exp."""
    if _FUSED_CPU is None or not _plain_causal_cpu(query, mask, valid, window):
        return None
    g = query.shape[1] // key.shape[1]
    if g > 1:  # the kernel takes as many K/V heads as query heads
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    out, lse = _FUSED_CPU(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), lse


def causal_attention_sums(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                          valid: Tensor, scaling: float, window: int | None,
                          ) -> tuple[Tensor, Tensor] | None:
    """The full cache's causal prefill attention ``[B, n, H, d]`` and each key's attention
    summed over the rows ``[B, H, n]`` (H2O's score), from one pass over the probabilities
    (``policies.sums.attention_with_sums``; equal to the fused kernel's output to float
    rounding). Where ``causal_attention_lse`` applies (on the CPU), else None."""
    if not _plain_causal_cpu(query, mask, valid, window):
        return None
    out, sums = attention_with_sums(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), sums


def _plain_causal_cpu(query: Tensor, mask: Tensor | None, valid: Tensor,
                      window: int | None) -> bool:
    """A CPU prompt with no padding, no sliding window and (if any) a plainly causal mask."""
    if (query.device.type != "cpu" or window is not None or query.shape[2] < 2
            or not bool(valid.all())):
        return False
    return mask is None or _is_causal_padding(mask, valid)


def _is_causal_padding(mask: Tensor, valid: Tensor) -> bool:
    """Whether the real rows of a 4-D prompt mask see exactly the real keys up to themselves."""
    n = valid.shape[-1]
    if mask.dim() != 4 or mask.shape[-2:] != (n, n):
        return False  # the general path reports the bad shape
    vis = as_bool(mask[:, 0])
    causal = torch.ones(n, n, dtype=torch.bool, device=vis.device).tril()
    expect = causal[None] & valid[:, None, :]
    return bool(((vis == expect) | ~valid[:, :, None]).all())


def keep_masked_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None,
                          keep: Tensor, scaling: float, recent: int = 0,
                          valid: Tensor | None = None) -> Tensor:
    """Prefill attention under the Attention-Gate mask (Zeng et al., "In-context KV-Cache
    Eviction for LLMs via Attention-Gate", arXiv:2410.12876, eq. 5).

    Query ``j`` sees key ``t`` iff ``allowed[b, j, t]`` and (``keep[b, h, t]`` or
    ``j - t < max(recent, 1)``: the diagonal, plus an optional always-visible recent band).
    ``allowed=None`` means causal over the real keys (``valid`` [B, n], default all real; a
    padding row sees itself only) and takes the blocked path.
    query [B, H, n, d], key/value [B, H_kv, n, d], allowed [B, n, n], keep [B, H_kv, n]
    (one flag per KV head, shared by its query heads). Returns [B, n, H, d].
    """
    if allowed is None:
        if valid is None:
            valid = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool,
                               device=query.device)
        if bool(valid.all()):
            whole = keep.all(-1).all(0)  # [H_kv]: heads that evict nothing, in every row
            if bool(whole.any()):
                return _whole_heads_apart(query, key, value, keep, valid, scaling,
                                          max(recent, 1), whole)
        return _blocked(query, key, value, keep, valid, scaling, max(recent, 1))
    return _general(query, key, value, allowed, keep, scaling, max(recent, 1))


def _whole_heads_apart(query: Tensor, key: Tensor, value: Tensor, keep: Tensor, valid: Tensor,
                       scaling: float, band: int, whole: Tensor) -> Tensor:
    """Unpadded prompts where some KV heads keep every key: those heads' eq. 5 is plain causal
    attention (one fused call for all of them), the others take the blocked path.

    Learned gates often decide per head: at 4k, ``cpt_long`` keeps all 4,096 entries in some
    heads of a layer and only its sinks and band in the others. Blocked together, every head's
    dense prefix is as long as the longest head's, so eq. 5 cost ~1.3x the full causal
    attention; apart, the whole heads cost their share of it and the rest almost nothing.
    """
    b, h, n, d = query.shape
    hk, dv = key.shape[1], value.shape[-1]
    g = h // hk
    q5 = query.view(b, hk, g, n, d)
    out = query.new_empty(b, n, hk, g, dv)
    kept, rest = whole.nonzero()[:, 0], (~whole).nonzero()[:, 0]  # a split of the head axis
    o = scaled_dot_product_attention(q5[:, kept].reshape(b, -1, n, d),
                                     key[:, kept].repeat_interleave(g, 1),
                                     value[:, kept].repeat_interleave(g, 1),
                                     is_causal=True, scale=scaling)
    out[:, :, kept] = o.view(b, len(kept), g, n, dv).permute(0, 3, 1, 2, 4)
    if len(rest):
        o = _blocked(q5[:, rest].reshape(b, -1, n, d), key[:, rest], value[:, rest],
                     keep[:, rest], valid, scaling, band)  # [B, n, |rest| * g, dv]
        out[:, :, rest] = o.view(b, n, len(rest), g, dv)
    return out.view(b, n, h, dv)


def _general(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, keep: Tensor,
             scaling: float, band: int) -> Tensor:
    b, h, n, d = query.shape
    hk = key.shape[1]
    g = h // hk
    q5 = query.view(b, hk, g, n, d)
    ki = torch.arange(n, device=query.device)
    out = []
    step = max(1, _MASK_ELEMS // max(1, b * h * n))
    for lo in range(0, n, step):  # row chunks bound the mask's memory, not a per-token loop
        hi = min(n, lo + step)
        r = hi - lo
        near = (ki[lo:hi, None] - ki[None, :] < band)[None, None]
        vis = allowed[:, None, lo:hi] & (keep[:, :, None, :] | near)  # [B, H_kv, r, n]
        # query heads folded into rows: one 4-D SDPA per KV head group, K/V never expanded
        q = q5[:, :, :, lo:hi].reshape(b, hk, g * r, d)
        m = query.new_zeros(b, hk, g, r, n).masked_fill_(~vis[:, :, None], float("-inf"))
        m = m.view(b, hk, g * r, n)  # additive: SDPA's fused CPU kernel takes it as is
        o = scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
        out.append(o.view(b, hk, g, r, -1))
    o = out[0] if len(out) == 1 else torch.cat(out, dim=3)
    return o.reshape(b, h, n, -1).transpose(1, 2)


def _blocked(query: Tensor, key: Tensor, value: Tensor, keep: Tensor, valid: Tensor,
             scaling: float, band: int) -> Tensor:
    """Causal + padding eq. 5 in blocks of query rows; exact, no n x n mask anywhere.

    For rows ``[lo, hi)`` the keys split in two disjoint sets: positions ``<= lo - band``,
    visible to every row of the block iff kept (a dense prefix of the kept keys, gathered per
    KV head in position order, padded to a multiple of ``_PREFIX_STEP`` keys; the shorter
    heads' padding is one column mask shared by all rows), and the window ``(lo - band, hi)``,
    masked row by row as eq. 5 says. The two attentions are merged by their log-sum-exps,
    which is exact.
    """
    b, h, n, d = query.shape
    hk, dv = key.shape[1], value.shape[-1]
    g = h // hk
    dev = query.device
    kept = keep & valid[:, None, :]  # [B, Hk, n]: pad keys are never visible to another row
    # kept keys first, each head's in position order: a stable sort of the "evicted" flag
    order = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices
    k_sorted = key.gather(2, order[..., None].expand(b, hk, n, d))
    v_sorted = value.gather(2, order[..., None].expand(b, hk, n, dv))
    count = kept.long().cumsum(-1)  # [B, Hk, n]: kept keys up to each position
    pos = torch.arange(n, device=dev)
    q5 = query.view(b, hk, g, n, d)
    out = query.new_empty(b, hk, g, n, dv)
    for lo in range(0, n, _BLOCK_ROWS):  # row blocks, not a per-token loop
        hi = min(n, lo + _BLOCK_ROWS)
        r, w0 = hi - lo, max(0, lo - band + 1)
        # query heads folded into rows: K/V of a KV head serve its g query heads unexpanded
        q = q5[:, :, :, lo:hi].reshape(b, hk, g * r, d)
        rows, cols = pos[lo:hi, None], pos[None, w0:hi]
        near = (rows - cols < band) & (cols <= rows)  # [r, w]
        win = (near[None, None] & (valid[:, None, None, w0:hi] | (rows == cols)[None, None])
               | (kept[:, :, None, w0:hi] & (cols <= rows)[None, None]))  # [B, Hk, r, w]
        mask = _additive(~win[:, :, None].expand(b, hk, g, r, hi - w0), query.dtype)
        o, lse = _attend(q, key[:, :, w0:hi], value[:, :, w0:hi],
                         mask.view(b, hk, g * r, -1), scaling)
        # dense prefix: kept keys at positions <= lo - band, a count per (row of B, KV head)
        pre = count[..., lo - band] if lo - band >= 0 else count.new_zeros(b, hk)
        m = int(pre.max())
        if m:
            # a bounded set of shapes (_PREFIX_STEP); m <= lo < n, so every column is a key
            m = min(-(-m // _PREFIX_STEP) * _PREFIX_STEP, lo)
            # [B, Hk, m]: padding of the shorter heads, and the columns past every head's
            short = pos[:m] >= pre[..., None]
            cmask = _additive(short[:, :, None], query.dtype) if bool(short.any()) else None
            o_pre, lse_pre = _attend(q, k_sorted[:, :, :m], v_sorted[:, :, :m], cmask, scaling)
            # a head with no old kept key sees nothing here (the fused kernel reports 0, not
            # -inf, as such a row's log-sum-exp)
            lse_pre = lse_pre.masked_fill((pre == 0)[..., None], float("-inf"))
            o, lse = _merge(o, lse, o_pre, lse_pre)
        out[:, :, :, lo:hi] = o.view(b, hk, g, r, dv)
    return out.reshape(b, h, n, dv).transpose(1, 2)


def _additive(hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive float mask (-inf where hidden): SDPA's fused CPU kernel reads it as is,
    while a boolean one is first converted by a separate pass as large as the mask."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf"))


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
            scaling: float) -> tuple[Tensor, Tensor]:
    """Softmax attention and its log-sum-exp per row (``-inf`` for a row that sees nothing)."""
    if q.device.type == "cpu" and _FUSED_CPU is not None:
        o, lse = _FUSED_CPU(q, k, v, attn_mask=mask, scale=scaling)
        return o, lse
    s = (q @ k.transpose(-1, -2)) * scaling  # other devices: the plain formula, block-sized
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp_min(torch.finfo(s.dtype).min))
    return p @ v, lse


def _merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two attentions over disjoint key sets, merged exactly into one."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.clamp_min(torch.finfo(lse.dtype).min)  # rows that see nothing in both
    w1 = torch.exp(lse1 - safe)[..., None]
    w2 = torch.exp(lse2 - safe)[..., None]
    o = torch.nan_to_num(o1 * w1, nan=0.0) + torch.nan_to_num(o2 * w2, nan=0.0)
    return o, lse


# SDPA's fused CPU kernel, called directly because it also returns the log-sum-exp the merge
# needs (the public function drops it); absent in other builds, where _attend falls back.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
