"""Forks of a filled ``CompressedCache``: one compressed context, many continuations.

A fork shares the kept keys/values with its source (``RaggedStore.fork``: the store never
writes into a tensor it holds) and clones the small per-layer state, so each fork may take
new tokens, decode and evict without the source or its other forks seeing any of it.
"""

from __future__ import annotations

import copy

from torch import Tensor

from kvgate.cache.compressed import CompressedCache, _Layer
from kvgate.cache.errors import CacheError


def _fork_layer(layer: _Layer) -> _Layer:
    if layer.pending:
        raise CacheError("cannot fork a cache in the middle of a forward pass")
    return _Layer(
        store=None if layer.store is None else layer.store.fork(),
        seen=layer.seen,
        real_seen=None if layer.real_seen is None else layer.real_seen.clone(),
        capacity=None if layer.capacity is None else layer.capacity.clone(),
        stats={k: v.clone() for k, v in layer.stats.items()},
    )


def fork_cache(cache: CompressedCache) -> CompressedCache:
    """An independent copy of ``cache`` (filled or not) that shares its stored K/V."""
    if not isinstance(cache, CompressedCache):
        raise CacheError(f"can only fork a CompressedCache, got {type(cache).__name__}")
    twin = copy.copy(cache)
    twin.layers = [_fork_layer(layer) for layer in cache.layers]
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
