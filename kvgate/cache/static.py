"""StaticDecodeCache: a filled ``CompressedCache`` frozen for decoding at fixed shapes.

Why: on a GPU, eager decode over the compressed cache is bound by the host (Python and kernel
launches), not by the bytes it reads, so holding half the entries does not make a step
faster. Here every decode step runs the same operations on tensors of the same shapes and
never reads a device value back to the host, so one step can be captured as a CUDA graph and
replayed (``kvgate.inference.graphed``); run eagerly it computes what ``CompressedCache``
computes.

Per layer the kept prompt entries become a dense base ``[B, H_kv, Tb, d]``, gathered once
(padded where heads keep different numbers, with a visibility mask), and the new tokens go to
a preallocated tail ``[B, H_kv, M, d]``: each step writes its key/value at slot ``step`` (a
one-element device tensor shared by the layers, advanced after the last layer) and attends to
the tail slots up to it. Tokens already appended to the compressed cache (a question after
its context) start the tail. Only for policies that evict nothing while decoding; sliding
window layers are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.cache.compressed import CompressedCache
from kvgate.cache.errors import CacheError
from kvgate.cache.handler import HandlerCache
from kvgate.policies.contract import DecodeEvicting


@dataclass
class _StaticLayer:
    base_k: Tensor  # [B, H_kv, Tb, d]
    base_v: Tensor
    base_visible: Tensor | None  # [B, H_kv, 1, Tb] bool; None when every head keeps as many
    tail_k: Tensor  # [B, H_kv, M, d]
    tail_v: Tensor
    tail_real: Tensor  # [B, 1, 1, M] bool: the real tokens the tail started with


class StaticDecodeCache(HandlerCache):
    """Decode over a compressed context at fixed shapes (see the module docstring).

    Build it with ``StaticDecodeCache.freeze(cache, max_new_tokens)`` from a filled
    ``CompressedCache`` (which stays usable: the base is a copy). Every forward through it
    takes one new token per row (``input_ids`` [B, 1]); pass ``position_ids`` (each row's next
    RoPE position) and ``cache_position``, as ``GraphedDecoder`` does, or let transformers
    derive them from ``get_seq_length``.
    """

    def __init__(self, layers: list[_StaticLayer], seen: int, start: int,
                 capacity: int) -> None:
        self.num_layers = len(layers)
        self.seen_at_freeze = seen  # tokens seen when frozen (padding included)
        self.start = start  # tail slots filled when frozen
        self.capacity = capacity  # tail slots in all
        first = layers[0].tail_k
        self.step = torch.full((1,), start, dtype=torch.long, device=first.device)
        self._slots = torch.arange(capacity, device=first.device)
        self.steps_taken = 0  # host-side count of decode forwards (graph replays included)
        self._pending = [False] * self.num_layers
        super().__init__(layers=layers)

    @classmethod
    def freeze(cls, cache: CompressedCache, max_new_tokens: int) -> StaticDecodeCache:
        """Copy a filled compressed cache into the fixed layout, with room for
        ``max_new_tokens`` decode steps."""
        if not isinstance(cache, CompressedCache):
            raise CacheError(f"StaticDecodeCache.freeze takes a CompressedCache, got "
                             f"{type(cache).__name__}")
        if isinstance(cache.policy, DecodeEvicting):
            raise CacheError(f"policy {cache.policy.name!r} evicts while decoding, which "
                             "changes the cache's shape every step; decode it with "
                             "CompressedCache")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise CacheError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if any(layer.store is None or layer.pending for layer in cache.layers):
            raise CacheError("StaticDecodeCache.freeze needs a filled cache: run the prefill "
                             "first (and not in the middle of a forward)")
        start = cache.layers[0].store.tail_len
        layers = [_freeze_layer(layer.store, start + max_new_tokens) for layer in cache.layers]
        return cls(layers, cache.layers[0].seen, start, start + max_new_tokens)

    # ----------------------------------------------------------------- transformers API

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[Tensor, Tensor]:
        """Pass-through: ``attend`` writes the new entry into the tail."""
        if self._pending[layer_idx]:  # the last forward never reached attend
            raise CacheError("StaticDecodeCache.attend was never called: route the model's "
                             "attention through kvgate (kvgate.models.dispatch.install(model))")
        self._pending[layer_idx] = True
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (padding included): transformers derives new positions from it."""
        return self.seen_at_freeze + self.steps_taken

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.layers[0].tail_k.shape[0]

    def bytes_held(self) -> int:
        """Bytes of the base and of the whole preallocated tail (K/V and masks)."""
        return sum(t.numel() * t.element_size() for la in self.layers
                   for t in (la.base_k, la.base_v, la.base_visible, la.tail_k, la.tail_v,
                             la.tail_real) if t is not None)

    def write_back(self, cache: CompressedCache) -> None:
        """Append the tokens decoded here to ``cache``, the compressed cache this one was
        frozen from, as eager decode would have: its entries, positions, tokens seen and bytes
        held then count the decoded tokens (one append per layer, no per-step work)."""
        steps = self.steps_taken
        if not steps:
            return
        lo, hi = self.start, self.start + steps
        for layer, frozen in zip(cache.layers, self.layers):
            offsets = torch.arange(steps, device=layer.real_seen.device)
            layer.store.append(frozen.tail_k[:, :, lo:hi], frozen.tail_v[:, :, lo:hi],
                               layer.real_seen[:, None] + offsets, padded=False)
            layer.seen += steps
            layer.real_seen = layer.real_seen + steps

    def note_replays(self, count: int = 1) -> None:
        """Count decode steps run without Python (CUDA graph replays)."""
        self.steps_taken += count

    # ----------------------------------------------------------------- attention

    def attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None,
               **kwargs: Any) -> tuple[Tensor, None]:
        """One decode row per sample: write its key/value at tail slot ``step``, attend to
        the base and the tail up to it. Returns ``(out [B, 1, H, d], None)``."""
        idx = module.layer_idx
        layer = self.layers[idx]
        self._pending[idx] = False
        b, _, r, _ = query.shape
        if r != 1 or b != layer.tail_k.shape[0]:
            raise CacheError(f"StaticDecodeCache takes one new token for each of its "
                             f"{layer.tail_k.shape[0]} rows per forward, got {b} x {r}")
        if kwargs.get("sliding_window"):
            raise CacheError("StaticDecodeCache does not support sliding-window layers; "
                             "decode with CompressedCache")
        if self.steps_taken >= self.capacity - self.start:
            raise CacheError(f"StaticDecodeCache is full: it was frozen with room for "
                             f"{self.capacity - self.start} new tokens")
        if scaling is None:
            scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        layer.tail_k.index_copy_(2, self.step, key.to(layer.tail_k.dtype))
        layer.tail_v.index_copy_(2, self.step, value.to(layer.tail_v.dtype))
        fresh = (self._slots >= self.start) & (self._slots <= self.step)
        tail_visible = layer.tail_real | fresh
        out, _ = multipart_attention(query, [KVPart(layer.base_k, layer.base_v,
                                                    layer.base_visible),
                                             KVPart(layer.tail_k, layer.tail_v, tail_visible)],
                                     scaling)
        if idx == self.num_layers - 1:  # the forward's last layer: the step is done
            self.step.add_(1)
            self.steps_taken += 1
        return out, None

    def snapshot(self) -> tuple[Tensor, int]:
        """The decode position (to undo warm-up steps): restore with ``restore``."""
        return self.step.clone(), self.steps_taken

    def restore(self, state: tuple[Tensor, int]) -> None:
        """Back to a ``snapshot``: tail slots written since are overwritten by later steps
        and invisible until then."""
        self.step.copy_(state[0])
        self.steps_taken = state[1]

    def __repr__(self) -> str:
        return (f"StaticDecodeCache(layers={self.num_layers}, tail={self.start}+"
                f"{self.capacity - self.start})")


def _freeze_layer(store, capacity: int) -> _StaticLayer:
    """One layer's ragged store as a padded base (a copy) and a tail of ``capacity`` slots."""
    base_k, base_v = store.base_kv()
    base_k, base_v = base_k.clone(), base_v.clone()  # the source cache stays independent
    base_visible = None if store.uniform else store.base_slot_valid()[:, :, None, :]
    b, hk, _, d = base_k.shape
    tail_k = base_k.new_zeros(b, hk, capacity, d)
    tail_v = base_v.new_zeros(b, hk, capacity, base_v.shape[-1])
    tail_real = torch.zeros(b, 1, 1, capacity, dtype=torch.bool, device=base_k.device)
    start = store.tail_len
    if start:
        k, v = store.tail_kv()
        tail_k[:, :, :start], tail_v[:, :, :start] = k, v
        tail_real[:, 0, 0, :start] = store.tail_pos >= 0
    return _StaticLayer(base_k, base_v, base_visible, tail_k, tail_v, tail_real)
