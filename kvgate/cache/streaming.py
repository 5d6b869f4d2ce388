"""The prefill of a ``StreamingPrefill`` policy (RoCo): the prompt is encoded block by block,
the cache evicting after each block as it does while decoding; kept apart from the cache's
other prefills, in which the prompt attends whole (:mod:`kvgate.cache.compressed`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvgate.cache.prefill import positions_after
from kvgate.policies.contract import LayerPrompt, PolicyError, RowScoring


def stream_prefill(cache: Any, layer: Any, prompt: LayerPrompt, mask: Tensor | None,
                   window: int | None, kwargs: dict) -> Tensor:
    """Evict-while-encoding in blocks of ``policy.block`` rows (RoCo-style), per layer, for
    ``cache`` (the ``CompressedCache`` whose prefill this is; typed loosely, as naming it would
    import the cache back) and its ``layer`` state.

    Streaming one layer at a time equals feeding the model block by block: a layer's
    rows of block i depend only on the previous layer's rows up to block i and on this
    layer's own cache. Blocks are aligned to the end of the prompt, so a left-padded
    sample meets the same block boundaries as when it runs alone. The longest aligned
    prefix in which no sample exceeds its budget runs as one plain prefill (nothing would
    be evicted there); every later block is one ``decode_select(..., prefill=True)``.
    """
    query, key, value, valid, scaling = (prompt.query, prompt.key, prompt.value,
                                         prompt.valid, prompt.scaling)
    b, hk, n, _ = key.shape
    block = int(cache.policy.block)
    if block < 1:
        raise PolicyError(f"policy {cache.policy.name!r}: block must be >= 1, got {block}")
    cap = cache.budget.per_sample(valid.sum(-1))
    layer.capacity = cap[:, None].expand(b, hk).clone()
    fits = int((valid.long().cumsum(-1) <= cap[:, None]).sum(-1).min())
    n0 = max(0, n - -(-(n - fits) // block) * block)  # last aligned boundary <= fits
    outs = []
    if n0 > 0:
        head = prompt.head(n0)  # the rows that fit the budget
        m0 = None if mask is None else mask[..., :n0, :n0]
        out0, _ = sdpa_attention_forward(prompt.module, head.query, head.key, head.value, m0,
                                         scaling=scaling, dropout=0.0, **kwargs)
        keep = head.valid[:, None, :].expand(b, hk, n0)
        layer.store.append(head.key, head.value, positions_after(head.valid, layer.real_seen))
        kept = layer.store.rebuild(keep)
        stats = cache.policy.decode_init(head, keep)
        layer.stats = {k: layer.store.realign(v, kept) for k, v in stats.items()}
        layer.seen, layer.real_seen = n0, head.n_real
        outs.append(out0)
    lo = n0
    while lo < n:  # a loop over blocks, like decode steps
        hi = n - ((n - lo - 1) // block) * block  # next aligned boundary above lo
        written = prompt.span(lo, hi) if isinstance(cache.policy, RowScoring) else None
        outs.append(cache._step(layer, query[:, :, lo:hi], key[:, :, lo:hi],
                                value[:, :, lo:hi], valid[:, lo:hi], scaling, window,
                                evict=True, prefill=True, written=written))
        lo = hi
    if layer.store.tail_len:  # padding rows may still sit in the tail
        kept = layer.store.rebuild(layer.store.slot_valid())
        layer.stats = {k: layer.store.realign(v, kept) for k, v in layer.stats.items()}
    return torch.cat(outs, dim=1)
