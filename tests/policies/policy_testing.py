"""Synthetic inputs shared by the policy tests (random q/k/v, exact attention matrices)."""

from __future__ import annotations

import math

import torch

from kvgate.policies.base import LayerPrompt


def make_prompt(lengths=(24, 17), heads=4, kv_heads=2, dim=8, layer_idx=1, num_layers=4,
                seed=0, dtype=torch.float32) -> LayerPrompt:
    """Random post-RoPE q/k/v, left padded to max(lengths); padding holds garbage on purpose."""
    gen = torch.Generator().manual_seed(seed)
    b, n = len(lengths), max(lengths)
    q = torch.randn(b, heads, n, dim, generator=gen) * 2.0
    k = torch.randn(b, kv_heads, n, dim, generator=gen) * 2.0
    v = torch.randn(b, kv_heads, n, dim, generator=gen)
    valid = torch.arange(n)[None, :] >= (n - torch.tensor(lengths))[:, None]
    return LayerPrompt(layer_idx=layer_idx, num_layers=num_layers, query=q.to(dtype),
                       key=k.to(dtype), value=v.to(dtype), valid=valid,
                       scaling=1.0 / math.sqrt(dim))


def sample(prompt: LayerPrompt, i: int) -> LayerPrompt:
    """Sample ``i`` alone, cut to its real tokens (no padding)."""
    n_real = int(prompt.valid[i].sum())
    cut = slice(prompt.valid.shape[1] - n_real, None)
    return LayerPrompt(layer_idx=prompt.layer_idx, num_layers=prompt.num_layers,
                       query=prompt.query[i:i + 1, :, cut], key=prompt.key[i:i + 1, :, cut],
                       value=prompt.value[i:i + 1, :, cut],
                       valid=torch.ones(1, n_real, dtype=torch.bool), scaling=prompt.scaling)


def prompt_from_attention(attn: list[list[list[float]]], value=None, group: int = 1,
                          ) -> LayerPrompt:
    """A one-sample prompt whose causal attention equals ``attn`` exactly.

    attn [H_kv][n][n] (rows sum to 1 over j <= i); query i is the one-hot e_i and key j holds
    log A[., j], so softmax(q_i . k_j) over j <= i reproduces row i. Each KV head is repeated
    for ``group`` query heads.
    """
    a = torch.tensor(attn, dtype=torch.float64)
    hk, n, _ = a.shape
    logs = torch.log(a.clamp(min=1e-30)).clamp(min=-200.0)
    key = logs.transpose(-1, -2)  # [Hk, n(keys), n(dims = query rows)]
    query = torch.eye(n, dtype=torch.float64).expand(hk * group, n, n)
    value = torch.ones(hk, n, 1) if value is None else torch.as_tensor(value).float()
    return LayerPrompt(layer_idx=0, num_layers=1, query=query[None].float(),
                       key=key[None].float(), value=value[None],
                       valid=torch.ones(1, n, dtype=torch.bool), scaling=1.0)


def kept_positions(keep: torch.Tensor, b: int = 0, h: int = 0) -> set[int]:
    return set(torch.nonzero(keep[b, h]).flatten().tolist())


def decode_inputs(batch=2, heads=4, kv_heads=2, slots=12, rows=1, seed=0):
    """Random per-head slot stores: some invalid slots, distinct true positions, -inf logits at
    invalid slots. Returns (logits, valid, positions)."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(batch, kv_heads, slots, generator=gen) > 0.2
    valid[..., -1] = True  # the newest entry
    base = torch.randperm(4 * slots, generator=gen)[:slots].sort().values
    positions = base.expand(batch, kv_heads, slots).clone()
    positions[..., -1] = 4 * slots + 5
    positions = positions.masked_fill(~valid, -1)
    logits = torch.randn(batch, heads, rows, slots, generator=gen) * 2.0
    hidden = ~valid.repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
    logits = logits.masked_fill(hidden, -math.inf)
    return logits, valid, positions
