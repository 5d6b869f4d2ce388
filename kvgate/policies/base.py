"""The one question every eviction policy answers, and the shared pieces they use.

A policy looks at one layer's prompt and returns a boolean keep mask ``[B, H_kv, n]``
(True = the (token, KV head) entry stays in the cache). Everything downstream (cache
compaction, decode attention, %Evict) is shared, which is what makes comparisons fair.

Budget meaning, written down once: a budget is the number of prompt entries each KV head
keeps, given either as a ratio of the *real* (non-padding) prompt length or as an absolute
token count. Sinks, recent windows and observation windows are *inside* the budget.
A budget at or above the prompt length keeps everything (no-op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROUNDINGS = ("up", "nearest")  # how a ratio budget becomes a whole number of entries


class PolicyError(ValueError):
    """Bad policy name, option or budget; the message says which."""


@dataclass(frozen=True)
class Budget:
    """How many prompt entries each KV head keeps: ``ratio`` of the real length or ``tokens``.

    A ratio's count is rounded ``up`` (default: never below the ratio) or to the ``nearest``
    whole token, which keeps a ratio taken from another policy's eviction unbiased on average
    (matched budgets: on an 8-token prompt rounding up turns 22% eviction into 12.5%)."""

    ratio: float | None = None
    tokens: int | None = None
    rounding: str = "up"

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.tokens is None):
            raise PolicyError("budget: give exactly one of ratio (0, 1] or tokens (>= 1)")
        if self.rounding not in ROUNDINGS:
            raise PolicyError(f"budget rounding must be one of {', '.join(ROUNDINGS)}, "
                              f"got {self.rounding!r}")
        if self.ratio is not None and not (0.0 < float(self.ratio) <= 1.0):
            raise PolicyError(f"budget ratio must lie in (0, 1], got {self.ratio}")
        if self.tokens is not None and (int(self.tokens) != self.tokens or self.tokens < 1):
            raise PolicyError(f"budget tokens must be an integer >= 1, got {self.tokens}")

    @classmethod
    def parse(cls, value: float | str | Budget) -> Budget:
        """``0.5`` -> keep half; ``128`` (an integer > 1) -> keep 128 tokens per head."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError as exc:
                raise PolicyError(f"budget {value!r} is neither a ratio nor a token count") from exc
        if isinstance(value, bool):
            raise PolicyError(f"budget must be a number, got {value!r}")
        if isinstance(value, int) and value > 1:
            return cls(tokens=value)
        if isinstance(value, int) and value == 1:
            return cls(ratio=1.0)
        return cls(ratio=float(value))

    def per_sample(self, n_real: Tensor) -> Tensor:
        """Kept entries per KV head for each sample: ``[B]`` long, clamped to ``[1, n_real]``."""
        if self.ratio is not None:
            exact = n_real.to(torch.float64) * self.ratio
            kept = (torch.floor(exact + 0.5) if self.rounding == "nearest"
                    else torch.ceil(exact - 1e-9)).long()
        else:
            kept = torch.full_like(n_real, int(self.tokens))
        return torch.minimum(kept.clamp(min=1), n_real)

    def describe(self) -> str:
        return f"{self.ratio:g} of the prompt" if self.ratio is not None else f"{self.tokens} tokens"


@dataclass
class LayerPrompt:
    """What a policy sees of one layer at prefill. Shapes: B batch, H query heads, H_kv KV
    heads, n prompt length (left padded), d head dim, D hidden size. q/k are post-RoPE."""

    layer_idx: int
    num_layers: int
    query: Tensor  # [B, H, n, d]
    key: Tensor  # [B, H_kv, n, d]
    value: Tensor  # [B, H_kv, n, d]
    valid: Tensor  # [B, n] bool; False at left padding
    scaling: float  # softmax scale (1/sqrt(d) for LLaMA/Mistral)
    hidden: Tensor | None = None  # [B, n, D] the normalised layer input (learned gate)
    module: Any = None  # the attention module (gives the learned gate access to kv_gate)

    @property
    def n_real(self) -> Tensor:
        return self.valid.sum(-1)

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.key.shape[1]


class Policy:
    """Base class. Subclasses are dataclasses with validated options and implement ``keep``.

    ``encode_mask``: True when the policy evicts *inside* the prefill (the learned gate, eq. 5):
    later prompt rows then attend only to kept entries. Otherwise prefill attention is full and
    only the stored cache is compressed (SnapKV-style one-shot).
    ``needs_attention``: True when ``keep`` needs attention probabilities (so the attention
    backend must be able to produce them).
    ``decode_eviction``: True when the policy also holds the cache at a budget while decoding.
    ``budget_free``: True when ``keep`` ignores the budget (the full cache, the thresholded
    gate); an evaluation then runs it once, not once per budget.
    """

    name: str = "base"
    encode_mask: bool = False
    needs_attention: bool = False
    decode_eviction: bool = False
    budget_free: bool = False

    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """Return ``[B, H_kv, n]`` bool. Padding positions must be False."""
        raise NotImplementedError


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


def real_index(valid: Tensor) -> Tensor:
    """Index of each token among the real tokens of its row (``[B, n]`` long; pads before the
    first real token get -1). Makes sinks independent of how much left padding a row has."""
    return valid.long().cumsum(-1) - 1


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


def first_real(valid: Tensor, count: Tensor) -> Tensor:
    """The first ``count`` real tokens: valid [B, n], count [B] or [B, Hk] -> [B, 1|Hk, n]."""
    count = count.view(valid.shape[0], -1, 1)
    return valid[:, None, :] & (real_index(valid)[:, None, :] < count)


def last_real(valid: Tensor, count: Tensor) -> Tensor:
    """The last ``count`` real tokens: valid [B, n], count [B] or [B, Hk] -> [B, 1|Hk, n]."""
    count = count.view(valid.shape[0], -1, 1)
    n_real = valid.sum(-1).view(-1, 1, 1)
    return valid[:, None, :] & (real_index(valid)[:, None, :] >= n_real - count)


ROW_CHUNK_ELEMS = 1 << 24  # fp32 elements in one row-chunk of attention probabilities (64 MiB)


def attention_sums(query: Tensor, key: Tensor, valid: Tensor, scaling: float, first_row: int = 0,
                   *, row_weight: Tensor | None = None, logit_scale: Tensor | None = None,
                   squares: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Column sums of causal fp32 attention probabilities over query rows ``first_row..n-1``.

    query [B, H, n, d], key [B, H_kv, n, d], valid [B, n]. ``row_weight`` [B, n] multiplies
    each row (0 drops it); ``logit_scale`` [B] or [B, n] multiplies the scaled logits of each
    sample / row before the softmax (AhaKV's lambda'). Rows are processed in chunks so memory
    stays O(chunk * n). Returns [B, H, n] (and the sums of squared probabilities with
    ``squares=True``). Padding rows and columns contribute 0.
    """
    b, h, n, _ = query.shape
    g = h // key.shape[1]
    k = key.float().repeat_interleave(g, dim=1)
    cols = torch.arange(n, device=query.device)
    step = max(1, ROW_CHUNK_ELEMS // max(1, b * h * n))
    total = query.new_zeros((b, h, n), dtype=torch.float32)
    total_sq = query.new_zeros((b, h, n), dtype=torch.float32) if squares else None
    for start in range(max(0, first_row), n, step):
        rows = torch.arange(start, min(n, start + step), device=query.device)
        s = torch.matmul(query[:, :, rows].float(), k.transpose(-1, -2)) * scaling
        if logit_scale is not None:
            scale = logit_scale.float()
            scale = scale[:, None, None, None] if scale.dim() == 1 else scale[:, None, rows, None]
            s = s * scale
        allowed = (cols[None, :] <= rows[:, None])[None, None] & valid[:, None, None, :]
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1), nan=0.0)
        if row_weight is not None:
            p = p * row_weight[:, None, rows, None].to(p.dtype)
        total += p.sum(2)
        if total_sq is not None:
            total_sq += p.square().sum(2)
    return (total, total_sq) if squares else total


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


class ScoredPolicy(Policy):
    """A policy that scores every prompt entry and keeps forced entries plus the top scores.

    Subclasses implement ``scores`` (and ``forced`` for windows / sinks; ``layer_budget`` when
    the budget depends on the layer). Ada-KV reuses these three to reallocate across heads.
    """

    needs_attention = True

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """``[B, H_kv, n]`` float; higher = keep. Values at padding are meaningless."""
        raise NotImplementedError

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
        n_real = prompt.n_real
        kept = self.layer_budget(prompt, budget.per_sample(n_real))
        if bool((kept >= n_real).all()):
            return keep_all(prompt)
        scores = self.scores(prompt, budget)
        return select_topk(scores, kept, self.forced(prompt, kept), prompt.valid)
