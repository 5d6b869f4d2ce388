"""One prefill, many one-shot policies: ``SharedPrefill`` encodes a prompt once and fills one
``CompressedCache`` per (policy, budget) from it.

Why this is exact: a one-shot policy (H2O, SnapKV, TOVA, StreamingLLM, PyramidKV, Ada-KV, ...)
encodes the prompt with full causal attention and only then drops entries from what the cache
stores, as kvpress's presses do. Its choice in layer ``l`` never changes the hidden states of
layer ``l + 1``, so every such policy reads the very same prompt tensors, and one forward can
serve them all. Policies whose prefill itself depends on their choice cannot share it: a
streamed prefill (RoCo) and a gate encoding under its keep mask (the paper's eq. 5); they are
refused with one line.

Each filled cache is what ``CompressedCache(model, policy, budget)`` would hold after the same
prefill alone (``tests/cache/test_shared.py`` checks entry for entry and answer for answer), so
it can be forked and decoded like any other. An evaluation of N policies on one context pays
one prefill instead of N.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.cache.compressed import CompressedCache, _Layer
from kvgate.cache.errors import CacheError
from kvgate.cache.ragged import RaggedStore
from kvgate.models.load import sync_device
from kvgate.policies.contract import (
    Budget,
    EncodeMasking,
    LayerPrompt,
    PassScoring,
    Policy,
    PolicyError,
    StreamingPrefill,
    prefill_band,
)
from kvgate.policies.full import Full


def shares_prefill(policy: Policy) -> bool:
    """Whether ``policy`` can be served by a ``SharedPrefill`` whatever the prompt and model:
    a one-shot policy. Not a streamed prefill (refused by ``SharedPrefill`` at construction),
    nor a policy that may encode under its keep mask: a gate does so (eq. 5) when its trained
    config says ``prefill: gated``, which ``SharedPrefill`` learns only at the first layer and
    then refuses. Nor a ``PassScoring`` policy, whose extra passes run over its own cache.
    Callers that choose which policies to share decide with this."""
    return not isinstance(policy, (StreamingPrefill, EncodeMasking, PassScoring))


class SharedPrefill(CompressedCache):
    """A full cache whose prefill also fills ``caches[name]`` for every ``variants[name] =
    (policy, budget)``. Use it for one prefill forward (``logits_to_keep=1`` is enough), then
    read ``caches``; it takes no further tokens itself.

    ``seconds[name]``: the time that variant's choice and storing took inside the forward (the
    rest of the forward is shared; on a GPU timed between device synchronisations), so a
    variant's cost alone is about the forward's time minus every variant's seconds plus its own.
    """

    def __init__(self, model_or_config: nn.Module | Any,
                 variants: Mapping[str, tuple[Policy, Budget | float | str]]) -> None:
        super().__init__(model_or_config, Full(), Budget(ratio=1.0))
        if not variants:
            raise PolicyError("SharedPrefill needs at least one (policy, budget)")
        for name, (policy, _) in variants.items():
            if isinstance(policy, StreamingPrefill):
                raise PolicyError(f"{name}: policy {policy.name!r} streams the prompt block by "
                                  "block, so it cannot share a full prefill")
            if isinstance(policy, PassScoring):
                raise PolicyError(f"{name}: policy {policy.name!r} chooses after extra passes "
                                  "over its own cache, so it cannot share a prefill")
        self.caches = {name: CompressedCache(self.model_config, policy, budget)
                       for name, (policy, budget) in variants.items()}
        self.seconds = dict.fromkeys(self.caches, 0.0)

    def _wants_lse(self) -> bool:
        return any(cache._wants_lse() for cache in self.caches.values())

    def _prefill(self, layer: _Layer, prompt: LayerPrompt, mask: Tensor | None,
                 window: int | None, kwargs: dict) -> Tensor:
        out = super()._prefill(layer, prompt, mask, window, kwargs)
        # a fresh prompt view per policy object: what a policy memoises on it (H2O's column
        # sums) is reused across that policy's budgets, never read by another policy
        views: dict[int, LayerPrompt] = {}
        device = prompt.key.device
        sync_device(device)  # on a GPU the clock must wait for the queued kernels
        for name, cache in self.caches.items():
            t0 = time.perf_counter()
            view = views.setdefault(id(cache.policy), replace(prompt))
            _fill_layer(cache, view)
            sync_device(device)
            self.seconds[name] += time.perf_counter() - t0
        return out

    def _step(self, layer: _Layer, *args: Any, **kwargs: Any) -> Tensor:
        raise CacheError("a SharedPrefill serves one prefill; continue on one of its .caches "
                         "(fork it with kvgate.cache.fork.fork_cache)")


def _fill_layer(cache: CompressedCache, prompt: LayerPrompt) -> None:
    """Fill one layer of ``cache`` from a prompt encoded with full attention elsewhere: its
    policy chooses, nothing is attended. Refused for a policy whose prefill differs from a
    full one (streamed, or encoded under its keep mask)."""
    layer = cache._layer(prompt.layer_idx)
    if layer.store is not None:
        raise CacheError(f"layer {prompt.layer_idx} is already filled; use a new cache")
    if isinstance(cache.policy, StreamingPrefill):
        raise PolicyError(f"policy {cache.policy.name!r} streams the prompt block by block, "
                          "so it cannot share a full prefill")
    b, hk, _, d = prompt.key.shape
    keep = cache._keep(prompt)
    if prefill_band(cache.policy, prompt) is not None:
        raise PolicyError(f"policy {cache.policy.name!r} encodes the prompt under its keep "
                          "mask (eq. 5), so it cannot share a full prefill")
    layer.store = RaggedStore(b, hk, d, prompt.key.dtype, prompt.key.device)
    layer.real_seen = torch.zeros(b, dtype=torch.long, device=prompt.key.device)
    cache._store_kept(layer, prompt, keep)
    layer.capacity = cache._decode_capacity(layer.store.kept_counts(), prompt.n_real)
