"""One decode-time eviction round of a ``CompressedCache`` layer (``DecodeEvicting`` policies).

After new rows attended, the policy's per-slot statistics are grown to the new slots (0, or
what a ``RowScoring`` policy's ``row_stats`` gave for the new rows), ``decode_select`` decides
which slots stay, and what leaves is dropped from the store (``RaggedStore.evict``: marked
as holes, compacted once they pass a share). ``flush_tail``: a quantized store's tail joins
its base every ``TAIL_MAX`` tokens, under any policy.

``round_due``: a ``RowScoring`` policy's rounds wait for ``interval`` rows (its rows are
scored at the round, all at once); the rows written since the last round are the layer's
``unscored`` rows, and they stay the store's last slots until the round, because only a round
(its compaction) or ``flush_tail`` moves slots, and a due flush makes the round due first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvgate.cache.ragged import TAIL_MAX
from kvgate.policies.contract import DecodeEvicting, LayerPrompt, PolicyError, RowScoring


def grown_stats(stats: dict[str, Tensor], fresh: dict[str, Tensor], slots: int
                ) -> dict[str, Tensor]:
    """Each ``[B, H_kv, T_old]`` statistic grown to ``slots``: the new rows' own values
    ``fresh`` (``[B, H_kv, r]``) fill the last r slots (the tail's newest tokens), any slot
    between them starts at 0; a key only ``fresh`` has starts at 0 on the old slots."""
    out = {}
    for key in [*stats, *(k for k in fresh if k not in stats)]:
        old, new = stats.get(key), fresh.get(key)
        if old is None:
            old = new.new_zeros(*new.shape[:2], 0, dtype=torch.float32)
        r = 0 if new is None else new.shape[-1]
        parts = [old, old.new_zeros(*old.shape[:2], slots - old.shape[-1] - r)]
        out[key] = torch.cat(parts if new is None else [*parts, new.to(old.dtype)], dim=-1)
    return out


def round_due(policy: DecodeEvicting, layer: Any, written: LayerPrompt | None) -> bool:
    """Whether the decode step that wrote ``written`` (the new rows, for a ``RowScoring``
    policy) ends with an eviction round; the rows join ``layer.unscored`` until it does."""
    if not isinstance(policy, RowScoring):
        return True
    layer.unscored.append(written)
    layer.unscored_rows += written.valid.shape[1]
    return layer.unscored_rows >= policy.interval or flush_due(layer.store)


def decode_round(policy: DecodeEvicting, layer: Any, logits: Tensor, positions: Tensor,
                 prefill: bool, slot_valid: Tensor | None = None) -> None:
    """One ``decode_select`` round over a layer's stored slots (``layer``: the cache's
    per-layer state, whose ``store``, ``stats`` and ``unscored`` rows it updates). logits
    ``[B, H, r, T]`` of the new rows, positions ``[B, H_kv, T]`` (-1 at empty slots),
    ``slot_valid`` ``positions >= 0`` when the caller has it. A ``RowScoring`` policy's rows
    written since the last round are scored here, in one call."""
    store = layer.store
    fresh = {}
    if layer.unscored:
        fresh = policy.row_stats(LayerPrompt.joined(layer.unscored))
        layer.unscored, layer.unscored_rows = [], 0
    slot_valid = positions >= 0 if slot_valid is None else slot_valid
    stats = grown_stats(layer.stats, fresh, slot_valid.shape[-1])
    stats, keep = policy.decode_select(stats, logits, slot_valid, positions, layer.capacity,
                                       prefill=prefill)
    if keep.shape != slot_valid.shape:
        raise PolicyError(f"policy {policy.name!r}: decode_select returned keep of "
                          f"shape {tuple(keep.shape)}, expected {tuple(slot_valid.shape)}")
    keep = keep.to(torch.bool) & slot_valid
    dropped = slot_valid ^ keep  # the real slots that leave
    count = int(dropped.sum())  # the round's one read of the device
    if count:
        # usually marked as holes; compacted only once they pass a share (RaggedStore.drop)
        kept = store.drop(dropped, count)
        if kept is not None:
            stats = {k: store.realign(v, kept) for k, v in stats.items()}
        else:  # a hole's statistic is never read again: cleared, as a compaction would
            stats = {k: v.masked_fill(~keep, 0) for k, v in stats.items()}
    layer.stats = dict(stats)


def flush_due(store: Any) -> bool:
    """Whether ``flush_tail`` compacts the store now."""
    return store.kv.quantized and store.tail_len >= TAIL_MAX


def flush_tail(layer: Any) -> None:
    """A quantized store's tail (full precision) joins its base, quantized, once it holds
    ``TAIL_MAX`` tokens, whether or not anything was evicted (a one-shot policy's decode never
    compacts otherwise); the layer's per-slot statistics follow the new layout."""
    store = layer.store
    if flush_due(store):
        moves = store.rebuild(store.slot_valid())
        layer.stats = {k: store.realign(v, moves) for k, v in layer.stats.items()}
