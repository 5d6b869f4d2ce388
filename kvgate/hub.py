"""Is the Hugging Face hub reachable? One cheap check shared by model and data loading.

Offline, ``from_pretrained``/``load_dataset`` retry for minutes and end in a traceback from
deep inside an HTTP client; this reads the offline switches, then sends one HEAD request with
a short timeout, so callers can fail in seconds with a one-line message.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request

HUB_PROBE_TIMEOUT_S = float(os.environ.get("KVGATE_HUB_TIMEOUT", "3"))
_OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = {"1", "true", "yes", "on"}


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline_reason() -> str | None:
    """Why the hub cannot be used now, or None when it answers.

    The probe runs in a daemon thread because DNS resolution ignores socket timeouts.
    """
    for var in _OFFLINE_SWITCHES:
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    endpoint = hub_endpoint()
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(endpoint, method="HEAD")
            urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # the server answered; its status code does not matter here
        except Exception as err:  # noqa: BLE001  (any other failure means "unreachable")
            outcome.append(f"no connection to {endpoint}: {type(err).__name__}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"{endpoint} did not answer in {HUB_PROBE_TIMEOUT_S:g} s"
