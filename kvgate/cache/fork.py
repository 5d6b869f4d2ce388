"""Forks of a filled ``CompressedCache``: one compressed context, many continuations; and
``stack_caches``: several filled caches of one context as the rows of one batch.

A fork shares the kept keys/values with its source (``RaggedStore.fork``: the store never
writes into a tensor it holds) and clones the small per-layer state, so each fork may take
new tokens, decode and evict without the source or its other forks seeing any of it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from kvgate.cache.compressed import CompressedCache, _Layer
from kvgate.cache.errors import CacheError
from kvgate.cache.ragged import RaggedStore
from kvgate.policies.contract import DecodeEvicting
from kvgate.policies.full import Full


def fork_layer(layer: _Layer) -> _Layer:
    """One layer's state for a fork: the store shared, the small per-layer state cloned."""
    if layer.pending:
        raise CacheError("cannot fork a cache in the middle of a forward pass")
    return _Layer(
        store=None if layer.store is None else layer.store.fork(),
        seen=layer.seen,
        real_seen=None if layer.real_seen is None else layer.real_seen.clone(),
        capacity=None if layer.capacity is None else layer.capacity.clone(),
        stats={k: v.clone() for k, v in layer.stats.items()},
        unscored=list(layer.unscored),  # never written into: the rows themselves are shared
        unscored_rows=layer.unscored_rows,
    )


def fork_cache(cache: CompressedCache) -> CompressedCache:
    """An independent copy of ``cache`` (filled or not) that shares its stored K/V."""
    if not isinstance(cache, CompressedCache):
        raise CacheError(f"can only fork a CompressedCache, got {type(cache).__name__}")
    twin = copy.copy(cache)
    twin.layers = [fork_layer(layer) for layer in cache.layers]
    return twin


def grow_capacity(cache: CompressedCache, extra: Tensor) -> None:
    """Raise every layer's decode capacity by ``extra`` [B] entries per KV head.

    Tokens appended after the prefill (a question over a compressed context) then add to what
    each head holds instead of evicting context entries as they arrive; a decode-evicting
    policy holds the heads at the new size afterwards.
    """
    for layer in cache.layers:
        if layer.capacity is not None:
            layer.capacity = layer.capacity + extra.to(layer.capacity)[:, None]


def stack_caches(caches: Sequence[CompressedCache], append_only: bool = False,
                 ) -> CompressedCache:
    """The rows of several filled caches of the same prompt length as one batch, so their
    continuations decode together (one forward per token for all of them).

    Made for one context compressed under several policies or budgets (``SharedPrefill``):
    every cache must have seen the same tokens; a decode-evicting policy only stacks with its
    own policy object (the batch decodes under one policy), unless ``append_only``: then any
    caches stack and the batch appends what follows without evicting (teacher scoring feeds
    its tokens so under every policy). The stacked cache shares the caches' K/V; nothing of
    theirs is modified.
    """
    if not caches or any(not isinstance(c, CompressedCache) for c in caches):
        raise CacheError("stack_caches takes a non-empty list of CompressedCache")
    lead = caches[0]
    evicting = [c for c in caches if isinstance(c.policy, DecodeEvicting)]
    if evicting and not append_only and any(c.policy is not lead.policy for c in caches):
        raise CacheError("a decode-evicting policy's cache stacks only with caches of the same "
                         "policy object (the batch decodes under one policy)")
    for c in caches:
        if c.num_layers != lead.num_layers or any(
                a.store is None or a.pending or a.store.tail_len or a.seen != b.seen
                for a, b in zip(c.layers, lead.layers)):
            raise CacheError("stack_caches needs filled caches of the same model, prompt length "
                             "and nothing appended since the prefill")
    twin = copy.copy(lead)
    twin.layers = [_stack_layers([c.layers[i] for c in caches]) for i in range(lead.num_layers)]
    if append_only:
        twin.policy = Full()  # appends, never evicts
    return twin


def concat_stores(stores: list[RaggedStore]) -> RaggedStore:
    """One store holding the samples of ``stores`` in order (their tails must be empty, as
    right after a prefill): each store's entries flat (their pages may differ), one after the
    other, placed on the pages of the whole. Shares nothing it could write into (``append`` /
    ``rebuild`` bind new tensors)."""
    first = stores[0]
    if any(s.tail_len or s.holes is not None or (s.kv_heads, s.head_dim, s.dtype, s.device, s.kv)
           != (first.kv_heads, first.head_dim, first.dtype, first.device, first.kv)
           for s in stores):
        raise ValueError("concat_stores needs stores of one layout with empty tails")
    out = RaggedStore(sum(s.batch for s in stores), first.kv_heads, first.head_dim, first.dtype,
                      first.device, first.kv)
    flat = [s.packed() for s in stores]
    out.next_pos = torch.cat([s.next_pos for s in stores])
    out.fill(type(flat[0][0]).cat([rows for rows, _ in flat]),
             torch.cat([pos for _, pos in flat]), torch.cat([s.counts for s in stores]))
    return out


def _stack_layers(layers: list[_Layer]) -> _Layer:
    store = concat_stores([la.store for la in layers])
    stats = {}
    for key in layers[0].stats:
        # per-slot statistics follow each sample's base layout: pad to the stacked one
        parts = [la.stats[key] for la in layers]
        stats[key] = torch.cat([torch.nn.functional.pad(p, (0, store.base_len - p.shape[-1]))
                                for p in parts])
    capacity = (None if layers[0].capacity is None
                else torch.cat([la.capacity for la in layers]))
    return _Layer(store=store, seen=layers[0].seen,
                  real_seen=torch.cat([la.real_seen for la in layers]),
                  capacity=capacity, stats=stats)
