"""Where oracle labels live and which KVzip computes them (``data.init_args.oracle``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kvgate.data.errors import DataError


class OracleError(DataError):
    """Oracle labels cannot be written or used: a bad setting, or labels of another base,
    KVzip or block layout; the message names which."""


@dataclass
class OracleLabels:
    """The labels' folder and the KVzip options they are computed with (arXiv:2505.23416;
    ``plus``: KVzip+, the target KVzap regresses, arXiv:2601.07891)."""

    path: str = "runs/oracle/labels"  # the folder: manifest.json + shard-NNNNN.safetensors
    plus: bool = True  # KVzip+ (attention x ||W_O v|| / ||h||) or plain KVzip
    chunk: int = 2048  # repeat-pass chunk (context tokens per extra forward)
    sinks: int = 4  # KVzip's always-kept first tokens (the gate's own sinks are its config's)
    # the training blocks are raw text, not a chat turn: the repeat request is asked plainly
    # unless this is on (then through the chat template, as kvgate's kvzip policy asks it)
    chat: bool = False
    shard_blocks: int = 8  # blocks per shard: what a killed run recomputes at most

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> OracleError:
            return OracleError(f"OracleLabels.{key}: {why} (got {getattr(self, key)!r})")

        if not isinstance(self.path, str) or not self.path.strip():
            raise bad("path", "must name a folder")
        for key in ("plus", "chat"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false")
        for key, low in (("chunk", 1), ("sinks", 0), ("shard_blocks", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad(key, f"must be an integer >= {low}")

    def kvzip(self) -> dict[str, Any]:
        """What makes two label sets the same scores (the manifest records it)."""
        return {"plus": self.plus, "chunk": self.chunk, "sinks": self.sinks, "chat": self.chat}

    def policy(self):
        """The ``kvzip`` policy whose passes compute the labels."""
        from kvgate.policies.kvzip import KVzip

        return KVzip(plus=self.plus, chunk=self.chunk, sinks=self.sinks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def oracle_settings(value: OracleLabels | dict | None) -> OracleLabels | None:
    """``data.init_args.oracle`` as ``OracleLabels`` (a plain mapping from a YAML file too)."""
    if value is None or isinstance(value, OracleLabels):
        return value
    if not isinstance(value, dict):
        raise OracleError(f"data.oracle: expected a mapping of OracleLabels settings, got "
                          f"{type(value).__name__}")
    known = {f.name for f in fields(OracleLabels)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise OracleError(f"OracleLabels: unknown key(s) {unknown}; known: {sorted(known)}")
    return OracleLabels(**value)
