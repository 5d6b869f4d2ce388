"""Shared pieces the policies are built from: top-k selection, GQA reduction, pooling, option
checks, seeded draws and the decode-time helpers; the attention sums (``kvgate.policies.sums``)
are re-exported.

The contract itself (``Budget``, ``LayerPrompt``, ``Policy`` and the ``DecodeEvicting`` /
``StreamingPrefill`` / ``EncodeMasking`` extensions) lives in ``kvgate.policies.contract`` and
is re-exported here, as are the mask helpers of ``kvgate.attention.masks``.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import Tensor

from kvgate.attention.masks import first_real, last_real, real_index
from kvgate.policies.contract import (
    ROUNDINGS,
    Budget,
    DecodeEvicting,
    EncodeMasking,
    LayerPrompt,
    PassAttention,
    PassScoring,
    Policy,
    PolicyError,
    RowScoring,
    StreamingPrefill,
    prefill_band,
)
from kvgate.policies.sums import attention_sums, attention_with_sums

__all__ = [
    "ALLOCATIONS", "ROUNDINGS", "AllocationOption", "Budget", "DecodeEvicting", "EncodeMasking",
    "LayerPrompt", "PassAttention", "PassScoring", "Policy", "PolicyError", "RowScoring",
    "ScoredPolicy", "StreamingPrefill", "attention_sums", "attention_with_sums", "by_position", "causal_probs",
    "check_choice", "check_decode", "check_int", "check_prompt", "check_share", "decode_probs",
    "first_real", "gqa_reduce", "keep_all", "last_real", "layer_seed", "make_policy",
    "option_error", "policy_options", "pool1d", "prefill_band", "real_index", "resolve_share",
    "seeded_uniform", "select_global", "select_layers", "select_topk", "stat",
]

ALLOCATIONS = ("head", "global")  # how a scored policy's budget is spread (AllocationOption)


# ---------------------------------------------------------------------------------------------
# shared primitives


def select_topk(scores: Tensor, k: Tensor, forced: Tensor | None, valid: Tensor) -> Tensor:
    """Keep mask from scores: ``forced`` entries plus the top-``k - |forced|`` of the rest.

    scores [B, Hk, n] float; k [B] or [B, Hk] long (total kept per head, forced included);
    forced [B, Hk, n] bool or None; valid [B, n] (prompt) or [B, Hk, n] (per-head slots, as in
    a decode store) bool. Ties break toward the lower index.
    Returns [B, Hk, n] bool with exactly min(k, n_real) True per (b, h).
    """
    b, hk, n = scores.shape
    valid3 = valid[:, None, :].expand(b, hk, n) if valid.dim() == 2 else valid
    forced = torch.zeros_like(valid3) if forced is None else (forced & valid3)
    if k.dim() == 1:
        k = k[:, None].expand(b, hk)
    # rank: forced first, then by score, then lower index first (stable sort on -score).
    # Infinite or NaN scores of valid entries are pulled inside (-big, big) so that they can
    # never rank below padding or above forced entries.
    big = torch.finfo(torch.float32).max
    key = torch.nan_to_num(scores.float(), nan=-big / 2, posinf=big / 2, neginf=-big / 2)
    key = key.masked_fill(~valid3, -big)
    key = torch.where(forced, torch.full_like(key, big), key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(n, device=scores.device).expand(b, hk, n))
    return (ranks < k[..., None]) & valid3


def select_global(scores: Tensor, kept: Tensor, forced: Tensor | None, valid: Tensor) -> Tensor:
    """Keep masks of every layer from one ranking over all layers and KV heads at once.

    scores [L, B, Hk, T] float (comparable across layers and heads); kept [B] long, the
    per-head budget: each sample keeps ``kept * L * Hk`` entries in all (forced included), the
    highest scores wherever they are, i.e. the bottom-k complement; forced [L, B, Hk, T] bool
    or None; valid [B, T] bool (slot t real in every layer and head). Ties break toward the
    lower layer, then head, then slot. Returns [L, B, Hk, T] bool.
    """
    layers, b, hk, t = scores.shape
    flat = scores.permute(1, 0, 2, 3).reshape(b, 1, -1)
    valid3 = valid[:, None, None, :].expand(b, layers, hk, t).reshape(b, 1, -1)
    fixed = None if forced is None else forced.permute(1, 0, 2, 3).reshape(b, 1, -1)
    keep = select_topk(flat, kept * layers * hk, fixed, valid3)
    return keep.view(b, layers, hk, t).permute(1, 0, 2, 3)


def select_layers(scores: Tensor, kept: Tensor, forced: Tensor | None, valid: Tensor,
                  allocation: str) -> Tensor:
    """``select_topk`` of every layer at once (``allocation="head"``: ``kept`` [B] entries per
    head) or ``select_global`` (``"global"``). Shapes as ``select_global``'s."""
    if allocation == "global":
        return select_global(scores, kept, forced, valid)
    layers, b, hk, t = scores.shape
    fold = (lambda x: x.permute(1, 0, 2, 3).reshape(b, layers * hk, t))  # layers as heads
    keep = select_topk(fold(scores), kept, None if forced is None else fold(forced), valid)
    return keep.view(b, layers, hk, t).permute(1, 0, 2, 3)


def gqa_reduce(x: Tensor, num_kv: int, how: str = "mean") -> Tensor:
    """Aggregate per-query-head scores ``[B, H, ...]`` to per-KV-head ``[B, H_kv, ...]``."""
    b, h = x.shape[:2]
    grouped = x.view(b, num_kv, h // num_kv, *x.shape[2:])
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    if how == "sum":
        return grouped.sum(2)
    raise PolicyError(f"gqa aggregation must be mean, max or sum, got {how!r}")


def causal_probs(query: Tensor, key: Tensor, valid: Tensor, scaling: float,
                 rows: slice | None = None) -> Tensor:
    """fp32 attention probabilities of (a slice of) query rows over all keys.

    query [B, H, n, d], key [B, H_kv, n, d]; returns [B, H, r, n] with causal + padding masks,
    normalised over every visible key. Rows of padding queries are all zero.
    """
    _, h, n, _ = query.shape
    rows = rows or slice(0, n)
    q = query[:, :, rows].float()
    k = key.float().repeat_interleave(h // key.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scaling
    qi = torch.arange(n, device=query.device)[rows]
    allowed = (torch.arange(n, device=query.device)[None, :] <= qi[:, None])[None, None]
    allowed = allowed & valid[:, None, None, :]
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)


# ---------------------------------------------------------------------------------------------
# option checks (every policy names the offending option the same way)


def option_error(policy: str, option: str, why: str, value: Any) -> PolicyError:
    return PolicyError(f"{policy}.{option}: {why} (got {value!r})")


def policy_options(cls: type[Policy]) -> list[str]:
    """Option names a policy class accepts (its dataclass init fields; keyword-only ones such
    as ``allocation`` last)."""
    if not is_dataclass(cls):
        return []
    init = [f for f in fields(cls) if f.init]
    return [f.name for f in init if not f.kw_only] + [f.name for f in init if f.kw_only]


def make_policy(cls: type[Policy], **options: Any) -> Policy:
    """``cls(**options)`` after checking the option names (unknown option -> PolicyError)."""
    known = policy_options(cls)
    unknown = [key for key in options if key not in known]
    if unknown:
        accepted = ", ".join(known) if known else "none"
        raise PolicyError(f"policy {cls.name!r} has no option {unknown[0]!r}; "
                          f"its options: {accepted}")
    return cls(**options)


def check_int(policy: str, option: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise option_error(policy, option, f"must be an integer >= {minimum}", value)


def check_choice(policy: str, option: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise option_error(policy, option, f"must be one of {', '.join(choices)}", value)


def check_share(policy: str, option: str, value: Any) -> None:
    """A share given as a float in [0, 1] (fraction) or an int >= 0 (absolute tokens)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise option_error(policy, option, "must be a float share in [0, 1] or an int count", value)
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise option_error(policy, option, "a float share must lie in [0, 1]", value)
    if isinstance(value, int) and value < 0:
        raise option_error(policy, option, "a token count must be >= 0", value)


def resolve_share(value: float, total: Tensor) -> Tensor:
    """Tokens for a share of ``total`` ([...] long): floor(value * total) for a float,
    ``value`` for an int; clamped to ``[0, total]``."""
    if isinstance(value, float):
        out = torch.floor(total.to(torch.float64) * value + 1e-9).long()
    else:
        out = torch.full_like(total, value)
    return torch.minimum(out.clamp(min=0), total)


# ---------------------------------------------------------------------------------------------
# prompt helpers


def check_prompt(prompt: LayerPrompt) -> None:
    """Shape checks a policy relies on; a one-line PolicyError instead of a deep torch error."""
    q, k, v, valid = prompt.query, prompt.key, prompt.value, prompt.valid
    if q.dim() != 4 or k.dim() != 4:
        raise PolicyError(f"prompt query/key must be 4-d [B, H, n, d], got {tuple(q.shape)} "
                          f"and {tuple(k.shape)}")
    b, h, n, _ = q.shape
    if k.shape[0] != b or k.shape[2] != n or h % k.shape[1] != 0:
        raise PolicyError(f"prompt key {tuple(k.shape)} does not match query {tuple(q.shape)} "
                          "(same batch and length; query heads a multiple of KV heads)")
    if v is not None and v.shape[:3] != k.shape[:3]:
        raise PolicyError(f"prompt value {tuple(v.shape)} does not match key {tuple(k.shape)}")
    if valid.shape != (b, n) or valid.dtype != torch.bool:
        raise PolicyError(f"prompt valid must be bool [B, n] = {(b, n)}, got "
                          f"{valid.dtype} {tuple(valid.shape)}")
    if not 0 <= prompt.layer_idx < max(prompt.num_layers, 1):
        raise PolicyError(f"layer_idx {prompt.layer_idx} outside [0, num_layers="
                          f"{prompt.num_layers})")


def keep_all(prompt: LayerPrompt) -> Tensor:
    """Every real entry kept: ``[B, H_kv, n]`` bool."""
    b, n = prompt.valid.shape
    return prompt.valid[:, None, :].expand(b, prompt.key.shape[1], n).clone()


def layer_seed(seed: int, layer_idx: int) -> int:
    """One RNG seed per (seed, layer): layers draw independent streams."""
    return (seed * 0x9E3779B1 + layer_idx * 0x85EBCA77 + 0x165667B1) % (2 ** 63 - 1)


def seeded_uniform(prompt: LayerPrompt, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform [0, 1) draws ``[B, H_kv, n]`` from a CPU generator seeded per (seed, layer),
    drawn position-major and indexed by each token's index among the real tokens: every head
    gets its own stream and a left-padded sample draws what it would draw alone."""
    hk = prompt.key.shape[1]
    gen = torch.Generator().manual_seed(layer_seed(seed, prompt.layer_idx))
    length = int(prompt.n_real.max().clamp(min=1))
    u = torch.rand((length, hk), generator=gen, dtype=dtype)
    idx = real_index(prompt.valid).clamp(min=0).cpu()
    return u[idx].permute(0, 2, 1).to(prompt.key.device)


def pool1d(x: Tensor, kernel: int, kind: str, mask: Tensor | None = None,
           count_include_pad: bool = True) -> Tensor:
    """Same-length pooling along the last axis (stride 1, padding kernel // 2).

    x [..., n] float; kernel odd. Entries where ``mask`` (broadcastable to x) is False do not
    take part: they count as the zero padding (avg) or -inf padding (max), so a left-padded
    row pools exactly like the same row alone. ``count_include_pad=True`` divides by
    ``kernel`` at the edges (PyTorch's avg_pool1d default, what SnapKV does).
    """
    if kernel <= 1 or kind == "none":
        return x
    if kernel % 2 == 0:
        raise PolicyError(f"pooling kernel must be odd to keep the length, got {kernel}")
    shape = x.shape
    flat = x.float().reshape(-1, 1, shape[-1])
    keep = None if mask is None else torch.broadcast_to(mask, shape).reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if kind == "max":
        if keep is not None:
            flat = flat.masked_fill(~keep, -math.inf)
        out = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad)
    elif kind == "avg":
        if keep is not None:
            flat = flat.masked_fill(~keep, 0.0)
        out = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=pad,
                                             count_include_pad=True)
        if not count_include_pad:
            ones = torch.ones_like(flat) if keep is None else keep.to(flat.dtype)
            count = torch.nn.functional.avg_pool1d(ones, kernel, stride=1, padding=pad,
                                                   count_include_pad=True)
            out = out / count.clamp(min=1.0 / kernel)
    else:
        raise PolicyError(f"pooling must be avg, max or none, got {kind!r}")
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# decode-time helpers (per-head slot layout [B, H_kv, T])


def check_decode(logits: Tensor, valid: Tensor, positions: Tensor, capacity: Tensor) -> None:
    """Shapes of ``decode_select``'s inputs; one-line PolicyError on mismatch."""
    if logits.dim() != 4:
        raise PolicyError(f"decode logits must be [B, H, r, T], got {tuple(logits.shape)}")
    b, h, _, t = logits.shape
    if valid.dim() != 3 or valid.shape[0] != b or valid.shape[2] != t or h % valid.shape[1]:
        raise PolicyError(f"decode valid {tuple(valid.shape)} does not fit logits "
                          f"{tuple(logits.shape)} (want [B, H_kv, T], H a multiple of H_kv)")
    if valid.dtype != torch.bool:
        raise PolicyError(f"decode valid must be bool, got {valid.dtype}")
    if positions.shape != valid.shape:
        raise PolicyError(f"decode positions {tuple(positions.shape)} must match valid "
                          f"{tuple(valid.shape)}")
    if capacity.shape != valid.shape[:2]:
        raise PolicyError(f"decode capacity must be [B, H_kv] = {tuple(valid.shape[:2])}, got "
                          f"{tuple(capacity.shape)}")


def decode_probs(logits: Tensor) -> Tensor:
    """fp32 softmax of stored-entry logits ``[B, H, r, T]``; all-hidden rows become zeros."""
    return torch.nan_to_num(torch.softmax(logits.float(), dim=-1), nan=0.0)


def by_position(positions: Tensor, valid: Tensor, count: Tensor, newest: bool) -> Tensor:
    """The ``count`` newest (or oldest) valid slots by true position.

    positions [B, Hk, T] long, valid [B, Hk, T] bool, count [B, Hk] long -> [B, Hk, T] bool.
    """
    key = positions.float() if newest else -positions.float()
    return select_topk(key, count, None, valid)


def stat(stats: dict[str, Tensor], name: str, like: Tensor) -> Tensor:
    """A running statistic, or zeros shaped like ``like`` when the cache has none yet."""
    value = stats.get(name)
    return torch.zeros_like(like, dtype=torch.float32) if value is None else value.float()


# ---------------------------------------------------------------------------------------------
# score-based policies


@dataclass
class AllocationOption:
    """The ``allocation`` option of a scored policy: where its budget goes.

    ``"head"`` (default): every KV head of every layer keeps the budget's count (``Budget``).
    ``"global"``: one ranking over all layers and KV heads at once (kvpress's default for
    KVzip): each sample keeps ``budget x layers x KV heads`` entries in all (the budget's
    per-head count times the heads, forced entries included), the highest
    ``global_scores`` wherever they are, and each head holds what it won (the ragged store
    holds heads of any size). That needs every layer's scores first: the cache stores the whole
    prompt and chooses for all layers after the last layer's prefill (``kvgate.cache.passes``);
    the prefill itself attends fully, as for any one-shot policy, so nothing else changes.
    Layer budgets (PyramidKV) and per-layer reallocation (Ada-KV) are ignored by a global
    ranking, so those policies refuse it.
    """

    allocation: str = field(default="head", kw_only=True, metadata={"omit_default": True})

    allocations = ALLOCATIONS  # the values this policy accepts

    def check_allocation(self) -> None:
        check_choice(self.name, "allocation", self.allocation, self.allocations)

    def global_scores(self, scores: Tensor, candidates: Tensor) -> Tensor:
        """Scores made comparable across layers and heads for a global ranking: each (layer,
        KV head)'s scores divided by their sum over its ``candidates`` (real, not forced
        entries), so every head spreads one unit of attention mass and a head that attends to
        a few entries ranks them above a head whose attention is flat. Raw attention sums do
        not compare across layers (their scale follows each layer's attention pattern).
        scores [B, Hk, n], candidates [B, Hk, n] bool -> [B, Hk, n] float."""
        s = scores.float().masked_fill(~candidates, 0.0)
        return s / s.sum(-1, keepdim=True).clamp(min=1e-30)


class ScoredPolicy(Policy):
    """A policy that scores every prompt entry and keeps forced entries plus the top scores.

    Subclasses implement ``scores`` (and ``forced`` for windows / sinks; ``layer_budget`` when
    the budget depends on the layer). Ada-KV reuses these three to reallocate across heads.
    """

    needs_attention = True

    @abstractmethod
    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]`` float; higher = keep. Values at padding are meaningless."""

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        """Always-kept entries ``[B, H_kv, n]`` bool for ``kept`` ([B] or [B, H_kv] long) entries
        per head."""
        b, hk, n = prompt.key.shape[:3]
        return torch.zeros((b, hk, n), dtype=torch.bool, device=prompt.key.device)

    def layer_budget(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        """Entries per head in this layer ([B] long) given the uniform per-head budget."""
        return kept

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        check_prompt(prompt)
        if isinstance(self, AllocationOption) and self.allocation != "head":
            raise PolicyError(f"{self.name}.allocation={self.allocation!r} ranks all layers at "
                              "once: it runs through CompressedCache, not one layer's keep")
        n_real = prompt.n_real
        kept = self.layer_budget(prompt, budget.per_sample(n_real))
        if bool((kept >= n_real).all()):
            return keep_all(prompt)
        scores = self.scores(prompt, budget)
        return select_topk(scores, kept, self.forced(prompt, kept), prompt.valid)
