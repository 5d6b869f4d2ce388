"""The transformers ``Cache`` surface of kvgate's caches that compute attention themselves.

``CompressedCache``, ``StaticDecodeCache`` and the masked evaluation's scoring cache answer
transformers' questions the same way: every mask is sized by the tokens *seen* (padding
included, ``get_seq_length``, which each defines), so new tokens get their true positions;
no layer is sliding at transformers' level (windows are applied in ``attend`` from the true
positions); nothing is compiled.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

from kvgate.models.dispatch import AttentionHandler


class HandlerCache(Cache, AttentionHandler):
    """Base of a cache the router hands every attention call (``AttentionHandler``); sets
    ``num_layers`` and defines ``get_seq_length``."""

    num_layers: int

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers
