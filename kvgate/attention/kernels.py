"""Names of the gated-attention kernels: one list for the dispatch in ``gated_attention`` and
for ``GateConfig.kernel``'s validation (kept free of torch so the config stays light)."""

from __future__ import annotations

from typing import Literal, get_args

# "chunked": kvgate.attention.gated (any device); "flex": kvgate.attention.flex (block-sparse,
# CUDA training); "triton": kvgate.attention.triton_kernel (FlashAttention-2-style, CUDA);
# "auto": one of them per device (gated.choose_kernel)
AttentionKernel = Literal["auto", "chunked", "flex", "triton"]
KERNELS: tuple[str, ...] = get_args(AttentionKernel)
