"""PyramidKV: SnapKV scoring with a per-layer budget that shrinks linearly with depth.

Paper: "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
Cai et al. 2024, arXiv:2406.02069. Rule: attention is broad in the lower layers and
concentrated in the upper ones, so lower layers get more of the cache and upper layers less
(same total); inside a layer the entries are chosen as SnapKV chooses them.

Per sample, with ``base = B - w`` selected entries per head on average and ``n`` real tokens::

    min = base / beta ; max = 2 * base - min
    if max >= n - w: max = n - w ; min = 2 * base - max
    B_sel(l) = round(max - l * (max - min) / (L - 1)) ;  B(l) = B_sel(l) + w

That is kvpress's float version (mean over layers = base up to rounding), the default. The
reference (KVCache-Factory) uses integer ``min = base // beta`` and ``step = (max - min) //
(L - 1)``, whose truncation overshoots the total budget by up to ~15%; ``integer_step=True``
reproduces it. Unlike KVCache-Factory there is no fallback to uniform budgets for short
prompts (kvpress behaviour). A single-layer model gets the uniform budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.policies.base import LayerPrompt, option_error
from kvgate.policies.snapkv import SnapKV


def pyramid_selected(base: Tensor, available: Tensor, layer: int, num_layers: int,
                     beta: float, integer_step: bool) -> Tensor:
    """Selected entries per head (window excluded) for ``layer``: base and available [B] long
    (available = n - w); returns [B] long in ``[0, available]``."""
    if num_layers <= 1:
        return torch.minimum(base, available)
    if integer_step:
        low = torch.div(base, beta, rounding_mode="floor").long()
        high = 2 * base - low
        clip = high >= available
        high = torch.where(clip, available, high)
        low = torch.where(clip, 2 * base - high, low)
        step = torch.div(high - low, num_layers - 1, rounding_mode="floor")
        sel = high - layer * step
    else:
        basef, availf = base.double(), available.double()
        low = basef / beta
        high = 2 * basef - low
        clip = high >= availf
        high = torch.where(clip, availf, high)
        low = torch.where(clip, 2 * basef - high, low)
        sel = torch.round(high - layer * (high - low) / (num_layers - 1)).long()
    return torch.minimum(sel.clamp(min=0), available)


@dataclass
class PyramidKV(SnapKV):
    """SnapKV whose per-head budget of layer ``l`` follows the pyramid (needs layer_idx and
    num_layers from the prompt)."""

    beta: float = 20.0
    integer_step: bool = False

    name = "pyramidkv"
    allocations = ("head",)  # its layer budgets are its rule: a global ranking ignores them

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) \
                or self.beta < 1:
            raise option_error(self.name, "beta", "must be a number >= 1", self.beta)
        if not isinstance(self.integer_step, bool):
            raise option_error(self.name, "integer_step", "must be true or false",
                               self.integer_step)

    def layer_budget(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        """Entries per head in this layer ([B] long, window included)."""
        w = self.window_len(kept, prompt.n_real)
        sel = pyramid_selected(kept - w, prompt.n_real - w, prompt.layer_idx,
                               prompt.num_layers, self.beta, self.integer_step)
        return sel + w
