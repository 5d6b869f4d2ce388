"""Names of the gated-attention kernels: one list for the dispatch in ``gated_attention`` and
for ``GateConfig.kernel``'s validation (kept free of torch so the config stays light)."""

from __future__ import annotations

from typing import Literal, get_args

from kvgate.errors import KVGateError

# "chunked": kvgate.attention.gated (any device); "triton": kvgate.attention.triton_kernel
# (FlashAttention-2-style, CUDA); "auto": one of them per device (gated.choose_kernel)
AttentionKernel = Literal["auto", "chunked", "triton"]
KERNELS: tuple[str, ...] = get_args(AttentionKernel)

# kernels that were removed, each with why and what replaced it: a saved config or a command
# that still names one is refused in one line saying so (check_kernel)
RETIRED_KERNELS: dict[str, str] = {
    "flex": "the block-sparse FlexAttention kernel was removed (never picked: 3.7-14x slower "
            "than the chunked one on an H200); use chunked, or triton on CUDA (auto picks per "
            "device)",
}


class KernelError(KVGateError, ValueError):
    """A gated-attention kernel name that is not one of ``KERNELS``; a removed one's message
    names what replaced it."""


def check_kernel(name: object, where: str = "kernel") -> str:
    """``name`` when it is one of ``KERNELS``; else ``KernelError`` naming ``where`` (the key
    or flag that gave it) and the kernels there are, or what replaced a removed one."""
    if name in KERNELS:
        return str(name)
    if isinstance(name, str) and name in RETIRED_KERNELS:
        raise KernelError(f"{where}: {name!r}: {RETIRED_KERNELS[name]}")
    raise KernelError(f"{where}: must be one of {list(KERNELS)} (got {name!r})")
