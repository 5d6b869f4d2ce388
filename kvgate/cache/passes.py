"""Choices a ``CompressedCache`` makes for all layers at once, after every layer's prefill.

Two kinds of policy need every layer's scores before they can choose:

- a scored policy with ``allocation="global"`` (``policies.base.AllocationOption``): one
  ranking over all layers and KV heads. Its prefill attends fully like any one-shot policy,
  so each layer stores its whole prompt and its comparable scores (``global_scores``) and
  forced entries; after the last layer's prefill the ranking keeps what it keeps in every
  layer (``choose_all``), inside the same forward;
- a ``PassScoring`` policy (KVzip): each layer stores its whole prompt and zero scores; the
  owner of the model runs the policy's extra passes (``kvgate.inference.compress.run_passes``),
  whose attention calls land in ``pass_attention`` (attend over the stored prompt and the
  pass's own rows, store nothing, raise the running scores), then calls ``choose_all``.

Scores live in the store's slot layout ``[B, H_kv, T]``: right after such a prefill every head
of a sample holds its real tokens in order, so slot t is the sample's t-th real token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from kvgate.cache.errors import CacheError
from kvgate.cache.prefill import _attend
from kvgate.policies.base import AllocationOption, select_layers
from kvgate.policies.contract import LayerPrompt, PassAttention, PassScoring, Policy

# pass rows per block: bounds the [B, H, rows, T + r] probabilities held at once
_PASS_ROWS = 512


def defers_choice(policy: Policy) -> bool:
    """Whether ``policy`` chooses for all layers at once (see the module docstring)."""
    return isinstance(policy, PassScoring) or (
        isinstance(policy, AllocationOption) and policy.allocation == "global")


def stash_layer(cache: Any, layer: Any, prompt: LayerPrompt, moves: Tensor) -> None:
    """After a layer stored its whole prompt (``moves``: the store's rebuild), keep what the
    all-layer choice will read: zero running scores for a ``PassScoring`` policy, else the
    comparable scores and forced entries of a globally allocated scored policy, in slot
    layout. After the last layer, a scored policy chooses at once."""
    policy, store = cache.policy, layer.store
    if isinstance(policy, PassScoring):
        layer.scores = cache.new_pass_scores(store)
        layer.forced = None
        cache.awaiting_passes = True
        return
    valid = prompt.valid
    kept = cache.budget.per_sample(prompt.n_real)
    forced = policy.forced(prompt, kept) & valid[:, None, :]
    scores = policy.global_scores(policy.scores(prompt, cache.budget),
                                  valid[:, None, :] & ~forced)
    layer.scores = store.realign(scores.float(), moves)
    layer.forced = store.realign(forced, moves)
    if prompt.layer_idx == cache.num_layers - 1:
        choose_all(cache)


def choose_all(cache: Any) -> None:
    """Every layer's keep mask from the stashed scores, then each store keeps only that."""
    layers = cache.layers
    if any(layer.scores is None for layer in layers):
        raise CacheError("an all-layer choice needs every layer's prefill first")
    if layers[0].scores.dim() != 3:
        raise CacheError("running scores of several scorers (SharedPasses) are chosen per "
                         "variant: split() the cache")
    store0 = layers[0].store
    valid = store0.base_slot_valid()[:, 0]  # [B, T]: every head holds the same real tokens
    scores = torch.stack([layer.scores for layer in layers])  # [L, B, H_kv, T]
    policy = cache.policy
    if isinstance(policy, PassScoring):
        keep = policy.choose(scores, valid, cache.budget)
    else:
        forced = torch.stack([layer.forced for layer in layers])
        keep = select_layers(scores, cache.budget.per_sample(valid.sum(-1)), forced, valid,
                             policy.allocation)
    for layer, k in zip(layers, keep):  # a loop over layers
        moves = layer.store.rebuild(k.to(torch.bool))
        layer.stats = {name: layer.store.realign(v, moves) for name, v in layer.stats.items()}
        layer.capacity = cache._decode_capacity(layer.store.kept_counts(), layer.real_seen)
        layer.scores = layer.forced = None
    cache.awaiting_passes = False


def running_scores(cache: Any) -> Tensor:
    """Every layer's scores after a ``PassScoring`` policy's passes and before its choice:
    ``[L, B, H_kv, T]`` fp32 in slot layout (slot t: the sample's t-th real token; padding
    slots hold 0). What ``choose_all`` would rank; the oracle labels store them."""
    if not cache.awaiting_passes or any(layer.scores is None for layer in cache.layers):
        raise CacheError("running scores exist between a PassScoring policy's prefill and "
                         "its choice")
    return torch.stack([layer.scores for layer in cache.layers])


@contextmanager
def extra_pass(cache: Any, valid: Tensor) -> Iterator[Any]:
    """Inside: every forward over ``cache`` is an extra pass of its ``PassScoring`` policy
    (``valid`` [B, r]: the pass's real rows), routed to ``pass_attention``."""
    if not cache.awaiting_passes:
        raise CacheError("extra passes need a PassScoring policy's prefill, not yet chosen")
    cache._pass_valid = valid.to(torch.bool)
    try:
        yield cache
    finally:
        cache._pass_valid = None


def pass_attention(cache: Any, layer: Any, module: Any, query: Tensor, key: Tensor,
                   value: Tensor, valid: Tensor, scaling: float, hidden: Tensor | None,
                   window: int | None) -> Tensor:
    """One layer's attention call of an extra pass: the pass rows attend over the stored
    prompt and their own causal rows; nothing is stored, no length changes; the policy's
    ``pass_scores`` of each block of rows raise the layer's running scores (max).

    query [B, H, r, d], key/value [B, H_kv, r, d] (the pass's own, post-RoPE), valid [B, r]
    (real pass rows). Returns [B, r, H, d] like transformers' attention functions.
    """
    if window:
        raise CacheError(f"policy {cache.policy.name!r}: extra passes over a sliding-window "
                         "layer are not supported")
    store = layer.store
    ck, cv = store.base_kv()  # [B, H_kv, T, d]
    stored = store.base_slot_valid()[:, 0]  # [B, T]
    b, h, r, _ = query.shape
    hk, t = ck.shape[1], ck.shape[2]
    g = h // hk
    ar = torch.arange(r, device=query.device)
    own = (ar[None, :] <= ar[:, None])[None] & valid[:, None, :]  # [B, r, r] causal + real
    hide = torch.cat([~stored[:, None, :].expand(b, r, t), ~own], dim=-1)  # [B, r, T + r]
    bias = torch.zeros(hide.shape, device=query.device).masked_fill_(hide, float("-inf"))
    # K/V per query head (the fused kernel takes as many as queries), fp32 like the scores
    keys = torch.cat([ck, key], dim=2).float().repeat_interleave(g, 1)  # [B, H, T + r, d]
    values = torch.cat([cv, value], dim=2).float().repeat_interleave(g, 1)
    q = query.float()
    out = query.new_empty(b, h, r, value.shape[-1])
    for lo in range(0, r, _PASS_ROWS):  # blocks of rows bound the probabilities' memory
        hi = min(r, lo + _PASS_ROWS)
        # the output and each row's log-sum-exp from the fused kernel (every row sees the
        # stored prompt: finite), then the probabilities on the stored entries alone
        o, lse = _attend(q[:, :, lo:hi], keys, values, bias[:, None, lo:hi], scaling)
        out[:, :, lo:hi] = o.to(out.dtype)
        probs = (q[:, :, lo:hi] * scaling) @ keys[:, :, :t].transpose(-1, -2)  # [B, H, rows, T]
        probs += bias[:, None, lo:hi, :t]
        probs.sub_(lse[..., None]).exp_()
        probs.masked_fill_(~valid[:, None, lo:hi, None], 0.0)  # padding rows: 0
        part = PassAttention(module.layer_idx, cache.num_layers, probs, valid[:, lo:hi], cv,
                             stored, None if hidden is None else hidden[:, lo:hi], module)
        layer.scores = torch.maximum(layer.scores, cache.score_pass(part))
    return out.transpose(1, 2)


__all__ = ["choose_all", "defers_choice", "extra_pass", "pass_attention", "running_scores",
           "stash_layer"]
