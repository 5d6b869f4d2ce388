"""Attention of a few new query rows over a cache held in several pieces.

The compressed cache holds a layer's keys in parts (the compacted base and the tail of tokens
appended since). Concatenating them every decode step would copy the whole cache (what a
dense cache does with ``torch.cat``); instead each part is scored on its own, the small
logit rows are joined for one softmax, and the outputs are summed. GQA is handled by folding
the query heads of a group into the row axis, so keys are never repeated per query head.
A part is dense (``KVPart``: ``[B, H_kv, T, d]``), held in pages per KV head
(``kvgate.attention.paged.PagedKV``) or flat (``kvgate.attention.rows.RowKV``): a ragged base
read where it lies.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from kvgate.attention.paged import PagedKV, paged_logits, paged_output
from kvgate.attention.rows import RowKV, row_logits, row_output, slot_logits


class KVPart(NamedTuple):
    """One piece of the cache: keys/values ``[B, H_kv, T, d]``; ``visible`` a bool mask
    4-D and broadcastable to ``[B, H_kv, r, T]`` (None = every slot visible to every row)."""

    keys: Tensor
    values: Tensor
    visible: Tensor | None


Part = KVPart | PagedKV | RowKV


def _length(part: Part) -> int:
    """The part's slots in the returned logits."""
    return part.keys.shape[2] if isinstance(part, KVPart) else part.slots


def _width(part: Part) -> int:
    """The part's columns in the joined logits (a flat part's rows, else its slots)."""
    return part.keys.shape[0] if isinstance(part, RowKV) else _length(part)


def multipart_attention(query: Tensor, parts: list[Part], scaling: float,
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
    hk = parts[0].keys.shape[1] if isinstance(parts[0], KVPart) else parts[0].kv_heads
    g = h // hk
    q = query.reshape(b, hk, g * r, d)
    scores = []
    for part in parts:  # a loop over the (two) parts
        if isinstance(part, RowKV):  # scaled and masked by its bias
            scores.append(row_logits(q, part, scaling))
            continue
        s = (paged_logits(q, part) if isinstance(part, PagedKV)
             else torch.matmul(q, part.keys.transpose(-1, -2)))
        s = (s if s.dtype == torch.float32 else s.float()).mul_(scaling)
        if part.visible is not None:
            t = s.shape[-1]
            hidden = ~part.visible.unsqueeze(2)  # [B, H_kv|1, 1 (group), r|1, T]
            s = s.view(b, hk, g, r, t).masked_fill(hidden, -math.inf).view(b, hk, g * r, t)
        scores.append(s)
    logits = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if all(p.visible is not None for p in parts):  # only then can a row see nothing
        probs = probs.nan_to_num_(0.0)
    out = None
    start = 0
    for part in parts:
        t = _width(part)
        p = probs[..., start:start + t]
        p = p if p.dtype == part.values.dtype else p.to(part.values.dtype)
        if isinstance(part, PagedKV):
            o = paged_output(p, part)
        elif isinstance(part, RowKV):
            o = row_output(p, part)
        else:
            o = torch.matmul(p, part.values)
        out = o if out is None else out + o
        start += t
    out = out.view(b, hk, g, r, d).reshape(b, h, r, d).transpose(1, 2)
    if not return_logits:
        return out, None
    logits = logits.view(b, hk, g, r, -1).reshape(b, h, r, -1)
    if any(isinstance(p, RowKV) for p in parts):  # flat rows back to the slot view
        pieces, start = [], 0
        for part in parts:  # a loop over the (two) parts
            piece = logits[..., start:start + _width(part)]
            pieces.append(slot_logits(piece, part) if isinstance(part, RowKV) else piece)
            start += _width(part)
        logits = torch.cat(pieces, dim=-1)
    return out, logits
