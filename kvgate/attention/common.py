"""What the gated-attention kernels share (the chunked one in ``gated`` and ``triton_kernel``):
kept here, below both, so the dispatcher in ``gated`` can import the other without it importing
the dispatcher back."""

from __future__ import annotations

from torch import Tensor

# Evicted keys that outscore every kept key would make P~ = exp(s - lse) explode; the clamp
# bounds their gradient (1 / e^-10 ~ 2e4 times a kept entry's) while leaving forward exact.
# Every kernel clamps at the same value, so their gate gradients agree.
EXP_CLAMP = 10.0


def keep_per_query_head(gate: Tensor, h: int) -> Tensor:
    """gate [B, Hg, n] (Hg = H_kv or H) -> bool keep [B, H, 1, n]."""
    keep = gate.detach() > 0.5
    if keep.shape[1] != h:
        keep = keep.repeat_interleave(h // keep.shape[1], dim=1)
    return keep[:, :, None, :]
