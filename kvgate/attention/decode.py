"""Attention of a few new query rows over a cache held in several pieces.

The compressed cache holds a layer's keys in parts (the compacted base and the tail of tokens
appended since). Concatenating them every decode step would copy the whole cache (what a
dense cache does with ``torch.cat``); instead each part is scored on its own, the small
logit rows are joined for one softmax, and the outputs are summed. GQA is handled by folding
the query heads of a group into the row axis, so keys are never repeated per query head.
A part is dense (``KVPart``: ``[B, H_kv, T, d]``) or held in pages per KV head
(``kvgate.attention.paged.PagedKV``: a ragged base read where it lies).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from kvgate.attention.paged import PagedKV, paged_logits, paged_output, paged_width


class KVPart(NamedTuple):
    """One piece of the cache: keys/values ``[B, H_kv, T, d]``; ``visible`` a bool mask
    4-D and broadcastable to ``[B, H_kv, r, T]`` (None = every slot visible to every row)."""

    keys: Tensor
    values: Tensor
    visible: Tensor | None


def _length(part: KVPart | PagedKV) -> int:
    return part.slots if isinstance(part, PagedKV) else part.keys.shape[2]


def _width(part: KVPart | PagedKV) -> int:
    """Columns a part takes in the logits buffer: a paged part's page grid is wider than its
    slots by the padding of the longest segment's last page."""
    return paged_width(part) if isinstance(part, PagedKV) else part.keys.shape[2]


def multipart_attention(query: Tensor, parts: list[KVPart | PagedKV], scaling: float,
                        return_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """Softmax attention of ``query`` [B, H, r, d] over the concatenation of ``parts``.

    Returns ``(out [B, r, H, d], logits)`` where ``out`` is transposed like transformers'
    attention functions return it and ``logits`` [B, H, r, T] (fp32, raw scaled, -inf where
    hidden; T = sum of the parts' lengths) is given only when asked for. Rows that see no key
    give zeros, as SDPA does.
    """
    b, h, r, d = query.shape
    parts = [p for p in parts if _length(p) > 0]
    if not parts:
        raise ValueError("multipart_attention: no keys to attend to")
    hk = parts[0].kv_heads if isinstance(parts[0], PagedKV) else parts[0].keys.shape[1]
    g = h // hk
    q = query.reshape(b, hk, g * r, d)
    widths = [_width(p) for p in parts]
    # one buffer for every part's logits: each part writes its columns, one softmax reads all
    logits = q.new_empty(b, hk, g * r, sum(widths), dtype=torch.float32)
    start = 0
    for part, w in zip(parts, widths):  # a loop over the (two) parts
        s = logits[..., start:start + w]
        if isinstance(part, PagedKV):
            paged_logits(q, part, scaling, s)
        else:
            s.copy_(torch.matmul(q, part.keys.transpose(-1, -2))).mul_(scaling)
        if part.visible is not None and not (isinstance(part, PagedKV) and part.bias is not None):
            t = _length(part)  # a page grid's columns past its slots hold -inf already
            hidden = ~part.visible.unsqueeze(2)  # [B, H_kv|1, 1 (group), r|1, T]
            s[..., :t].view(b, hk, g, r, t).masked_fill_(hidden, -math.inf)
        start += w
    probs = torch.softmax(logits, dim=-1)
    if all(p.visible is not None for p in parts):  # only then can a row see nothing
        probs = probs.nan_to_num_(0.0)
    out = None
    start = 0
    for part, w in zip(parts, widths):
        p = probs[..., start:start + w]
        p = p if p.dtype == part.values.dtype else p.to(part.values.dtype)
        o = paged_output(p, part) if isinstance(part, PagedKV) else torch.matmul(p, part.values)
        out = o if out is None else out + o
        start += w
    out = out.view(b, hk, g, r, d).reshape(b, h, r, d).transpose(1, 2)
    if not return_logits:
        return out, None
    if widths != [_length(p) for p in parts]:  # the slot view: each part's first slots
        starts = [sum(widths[:i]) for i in range(len(parts))]
        logits = torch.cat([logits[..., s:s + _length(p)] for s, p in zip(starts, parts)], -1)
    return out, logits.view(b, hk, g, r, -1).reshape(b, h, r, -1)
