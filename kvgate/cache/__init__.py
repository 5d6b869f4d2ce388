"""A KV cache that stores only the entries an eviction policy keeps (ragged per KV head)."""

from kvgate.cache.compressed import CompressedCache
from kvgate.cache.errors import CacheError
from kvgate.cache.ragged import RaggedStore

__all__ = ["CacheError", "CompressedCache", "RaggedStore"]
