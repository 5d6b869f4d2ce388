"""The one root of every error a user can cause (bad name, value, file, model or setting).

Each layer raises its own subclass (``PolicyError``, ``CacheError``, ``ModelLoadError``, ...),
so a message names the layer that refused; the command lines catch ``KVGateError`` alone and
print its first line. Subclasses keep their old ``ValueError`` / ``RuntimeError`` bases, so code
that caught those still works.
"""

from __future__ import annotations


class KVGateError(Exception):
    """Something the user can fix; the message says what and how."""
