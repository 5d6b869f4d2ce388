"""Masked-mode scoring: one forward over ``[context | continuations]`` per example.

The paper scores eviction without a compressed cache: the policy's keep decisions are applied
as attention masks in a single forward. Each row of a batch packs one example:

    [left padding | context (C columns) | choice 1 | choice 2 | ... | right padding]

Per layer the policy sees the context columns only (``LayerPrompt`` over the first C
columns, exactly what a cache-mode prefill of the context shows it) and returns
``keep [B, H_kv, C]``. Then:

- context rows attend as the prefill would: full causal attention for one-shot policies, the
  eq. 5 mask (later rows see only kept entries) for ``EncodeMasking`` policies (the learned gate);
- continuation rows see the kept context entries of their KV head, plus the earlier tokens of
  their *own* choice (never another choice's), as decoding over a compressed cache would.

Because every choice of an example shares one row, the context is encoded once and its keep
mask is computed once per example. Positions are the true token indices (padding skipped), and
each choice starts at the context length, so a choice is positioned as in its own sequence.

Policies that evict while encoding in blocks (``StreamingPrefill``, RoCo) are simulated by
their one-shot ``keep`` here (their own documented approximation); cache mode runs them for real.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.cache.handler import HandlerCache
from kvgate.cache.prefill import prompt_attention
from kvgate.eval.errors import EvalError, model_device, model_shape
from kvgate.models import dispatch
from kvgate.models.dispatch import ForwardContext
from kvgate.policies.base import Budget, LayerPrompt, Policy, PolicyError


@dataclass(frozen=True)
class ScoringItem:
    """One context with candidate continuations, already tokenised.

    ``context`` holds the context token ids (special tokens included), ``choices`` the ids of
    each continuation (non-empty), ``gold`` the correct choice, ``choice_chars`` the character
    length of each choice's text (for length-normalised accuracy).
    """

    uid: str
    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    gold: int = 0
    choice_chars: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.context:
            raise EvalError(f"item {self.uid}: the context has no tokens")
        if not self.choices or any(len(c) == 0 for c in self.choices):
            raise EvalError(f"item {self.uid}: needs at least one choice, each with tokens")
        if not 0 <= self.gold < len(self.choices):
            raise EvalError(f"item {self.uid}: gold {self.gold} outside {len(self.choices)} choices")


@dataclass
class ItemScore:
    """Scores of one item: summed log-likelihood and token count per choice, and what the
    policy kept of the context (entries over all layers and KV heads)."""

    uid: str
    loglik: list[float]
    tokens: list[int]
    n_ctx: int  # real context tokens
    kept: int  # kept (layer, KV head, token) entries of the context
    total: int  # L x H_kv x n_ctx
    # cache mode: entries held after each choice's continuation (None where no cache ran)
    held_end: list[int] | None = None

    @property
    def evict(self) -> float:
        """Evicted share of the context's (layer, KV head, token) entries."""
        return 1.0 - self.kept / max(self.total, 1)


# ---------------------------------------------------------------------------------------------
# packing


@dataclass
class PackedBatch:
    """Items packed one per row (see the module docstring). Shapes: B rows, T columns.

    input_ids / attention_mask / position_ids / segment: [B, T] long; segment is -1 at
    padding, 0 in the context and ``i + 1`` in choice ``i``. ``ctx_len`` = C.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    segment: Tensor
    ctx_len: int

    @property
    def ctx_valid(self) -> Tensor:
        """[B, C] bool: real context tokens."""
        return self.segment[:, : self.ctx_len] == 0


def pack(items: Sequence[ScoringItem], pad: int) -> PackedBatch:
    """Pack items one per row: context left padded to the longest, choices after it."""
    c = max(len(it.context) for it in items)
    t = c + max(sum(len(ch) for ch in it.choices) for it in items)
    b = len(items)
    ids = torch.full((b, t), pad, dtype=torch.long)
    seg = torch.full((b, t), -1, dtype=torch.long)
    pos = torch.zeros((b, t), dtype=torch.long)
    for row, it in enumerate(items):  # building the batch, not a hot path
        n = len(it.context)
        ids[row, c - n: c] = torch.tensor(it.context)
        seg[row, c - n: c] = 0
        pos[row, c - n: c] = torch.arange(n)
        col = c
        for i, ch in enumerate(it.choices):
            ids[row, col: col + len(ch)] = torch.tensor(ch)
            seg[row, col: col + len(ch)] = i + 1
            pos[row, col: col + len(ch)] = n + torch.arange(len(ch))
            col += len(ch)
    return PackedBatch(ids, (seg >= 0).long(), pos, seg, c)


def targets(packed: PackedBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Where each continuation token is predicted from.

    Returns (rows [N], cols [N], predictor [N]) over the N continuation tokens: the token at
    (row, col) is predicted by the output at column ``predictor``: the previous column inside
    the same choice, the last context column for a choice's first token.
    """
    seg, c = packed.segment, packed.ctx_len
    rows, cols = torch.nonzero(seg[:, c:] > 0, as_tuple=True)
    cols = cols + c
    same = seg[rows, cols - 1] == seg[rows, cols]
    predictor = torch.where(same, cols - 1, torch.full_like(cols, c - 1))
    return rows, cols, predictor


def gather_logprobs(logits: Tensor, first_col: int, packed: PackedBatch, rows: Tensor,
                    cols: Tensor, predictor: Tensor) -> Tensor:
    """Log-probability [N] of each target token; ``logits`` [B, T', V] covers columns
    ``first_col .. first_col + T' - 1``."""
    sel = logits[rows, predictor - first_col].float()  # [N, V]
    tok = packed.input_ids[rows, cols].to(sel.device)
    return sel.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(sel, dim=-1)


def sum_by_choice(logp: Tensor, packed: PackedBatch, rows: Tensor, cols: Tensor,
                  n_choices: int) -> tuple[Tensor, Tensor]:
    """Per (row, choice) summed log-probability and token count: two [B, K] tensors."""
    b = packed.segment.shape[0]
    flat = rows.to(logp.device) * n_choices + packed.segment[rows, cols].to(logp.device) - 1
    ll = torch.zeros(b * n_choices, dtype=torch.float64, device=logp.device)
    ll.index_add_(0, flat, logp.double())
    count = torch.zeros(b * n_choices, dtype=torch.long, device=logp.device)
    count.index_add_(0, flat, torch.ones_like(flat))
    return ll.view(b, n_choices), count.view(b, n_choices)


# ---------------------------------------------------------------------------------------------
# the attention object


def keep_for_rows(policy: Policy, prompt: LayerPrompt, budgets: Sequence[Budget]) -> Tensor:
    """``policy.keep`` with one budget per row: rows sharing a budget go in one call.

    Returns [B, H_kv, n] bool (padding False).
    """
    b, hk, n = prompt.key.shape[:3]
    groups: dict[Budget, list[int]] = {}
    for row, bud in enumerate(budgets):
        groups.setdefault(bud, []).append(row)
    if len(groups) == 1:
        keep = policy.keep(prompt, budgets[0])
    else:
        keep = torch.zeros((b, hk, n), dtype=torch.bool, device=prompt.key.device)
        for bud, rows in groups.items():  # one call per distinct budget (matched budgets)
            idx = torch.tensor(rows, device=prompt.key.device)
            keep[idx] = policy.keep(_rows(prompt, idx), bud).to(torch.bool)
    if tuple(keep.shape) != (b, hk, n):
        raise PolicyError(f"policy {policy.name!r} returned keep of shape {tuple(keep.shape)}, "
                          f"expected {(b, hk, n)}")
    return keep.to(torch.bool) & prompt.valid[:, None, :]


def _rows(prompt: LayerPrompt, idx: Tensor) -> LayerPrompt:
    """The prompt of some batch rows only."""
    def pick(x: Any) -> Any:
        if x is None:
            return None
        return tuple(t[idx] for t in x) if isinstance(x, tuple) else x[idx]

    return replace(prompt, query=prompt.query[idx], key=prompt.key[idx],
                   value=prompt.value[idx], valid=prompt.valid[idx], hidden=pick(prompt.hidden),
                   position_embeddings=pick(prompt.position_embeddings), lse=pick(prompt.lse))


class MaskedScoringCache(HandlerCache):
    """Attention handler for one packed forward (see the module docstring).

    Passed as ``past_key_values``; stores nothing. After the forward ``kept`` [B, L] holds
    the kept context entries per row and layer, and ``keeps`` (when ``record=True``) the keep
    masks ``[B, H_kv, C]`` of every layer.
    """

    def __init__(self, num_layers: int, policy: Policy, budgets: Sequence[Budget],
                 packed: PackedBatch, record: bool = False) -> None:
        super().__init__(layers=[object() for _ in range(num_layers)])
        self.num_layers = num_layers
        self.policy = policy
        self.budgets = list(budgets)
        self.ctx_len = packed.ctx_len
        self.segment = packed.segment
        self.positions = packed.position_ids
        self.record = record
        self.kept = torch.zeros((packed.segment.shape[0], num_layers), dtype=torch.long)
        self.keeps: list[Tensor | None] = [None] * num_layers

    # transformers asks these of any cache; nothing is stored, so every forward starts at 0
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None,
               hidden: Tensor | None = None, position_embeddings: Any = None,
               context: ForwardContext | None = None, **kwargs) -> tuple[Tensor, None]:
        """query [B, H, T, d], key/value [B, H_kv, T, d] (post-RoPE), hidden [B, T, D].
        Returns ``(out [B, T, H, d], None)``."""
        c = self.ctx_len
        t = query.shape[2]
        if scaling is None:
            scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        device = query.device
        seg = self.segment.to(device)
        valid = seg[:, :c] == 0
        qc, kc, vc = query[:, :, :c], key[:, :, :c], value[:, :, :c]
        # the policy sees the context columns only, as a cache-mode prefill of the context
        # would show them
        prompt = LayerPrompt(module.layer_idx, self.num_layers, qc, kc, vc, valid, scaling,
                             None if hidden is None else hidden[:, :c], module,
                             None if position_embeddings is None
                             else tuple(x[:, :c] for x in position_embeddings))
        keep = keep_for_rows(self.policy, prompt, self.budgets)  # [B, H_kv, C]
        self.kept[:, module.layer_idx] = keep.sum((1, 2)).cpu()
        if self.record:
            self.keeps[module.layer_idx] = keep.cpu()
        window = kwargs.get("sliding_window") or None
        ctx_mask = None if attention_mask is None else attention_mask[..., :c, :c]
        out_ctx = prompt_attention(self.policy, prompt, keep, ctx_mask, window, **kwargs)
        if t == c:
            return out_ctx, None
        # continuation rows: kept context entries of their KV head + their own choice, causally
        pos = self.positions.to(device)
        rows_pos = pos[:, None, c:, None]  # [B, 1, R, 1]
        ctx_vis = keep[:, :, None, :]  # [B, H_kv, 1, C]
        seg_r = seg[:, c:]
        cols = torch.arange(t - c, device=device)
        own = ((seg_r[:, :, None] == seg_r[:, None, :]) & (seg_r[:, None, :] > 0)
               & (cols[None, None, :] <= cols[None, :, None]))[:, None]  # [B, 1, R, R]
        if window:
            ctx_vis = ctx_vis & (pos[:, None, None, :c] > rows_pos - window)
            own = own & (pos[:, None, None, c:] > rows_pos - window)
        out_cont, _ = multipart_attention(
            query[:, :, c:], [KVPart(kc, vc, ctx_vis), KVPart(key[:, :, c:], value[:, :, c:], own)],
            scaling)
        return torch.cat([out_ctx, out_cont.to(out_ctx.dtype)], dim=1), None


@torch.no_grad()
def masked_scores(model: nn.Module, items: Sequence[ScoringItem], policy: Policy,
                  budgets: Sequence[Budget], pad: int = 0,
                  record: bool = False) -> tuple[list[ItemScore], list[Tensor] | None]:
    """Score one batch of items in masked mode (one forward, one row per item).

    budgets: one per item. Returns the item scores and, with ``record=True``, the keep masks
    of every layer stacked per item as ``[L, H_kv, n_ctx]`` bool (padding dropped).
    """
    if len(budgets) != len(items):
        raise EvalError(f"need one budget per item, got {len(budgets)} for {len(items)} items")
    dispatch.install(model)
    num_layers, kv_heads = model_shape(model)
    device = model_device(model)
    packed = pack(items, pad)
    cache = MaskedScoringCache(num_layers, policy, budgets, packed, record=record)
    rows, cols, predictor = targets(packed)
    c, t = packed.ctx_len, packed.segment.shape[1]
    # logits only where a continuation token is predicted: columns C-1 .. T-2
    out = model(input_ids=packed.input_ids.to(device),
                attention_mask=packed.attention_mask.to(device),
                position_ids=packed.position_ids.to(device), past_key_values=cache,
                use_cache=True, logits_to_keep=torch.arange(c - 1, t - 1, device=device))
    logp = gather_logprobs(out.logits, c - 1, packed, rows.to(device), cols.to(device),
                           predictor.to(device))
    k = max(len(it.choices) for it in items)
    ll, count = sum_by_choice(logp, packed, rows, cols, k)
    n_ctx = packed.ctx_valid.sum(-1)
    kept = cache.kept.sum(-1)
    scores = []
    for i, it in enumerate(items):
        m = len(it.choices)
        scores.append(ItemScore(it.uid, ll[i, :m].tolist(), count[i, :m].tolist(),
                                int(n_ctx[i]), int(kept[i]), num_layers * kv_heads * int(n_ctx[i])))
    patterns = None
    if record:
        full = torch.stack(cache.keeps)  # [L, B, H_kv, C]
        patterns = [full[:, i, :, c - int(n_ctx[i]):] for i in range(len(items))]
    return scores, patterns


def check_budget_ratio(value: float, rounding: str = "up") -> Budget:
    """A kept ratio from an eviction share, clamped into Budget's (0, 1]."""
    if math.isnan(value):
        raise EvalError("kept ratio is NaN")
    return Budget(ratio=min(1.0, max(float(value), 1e-9)), rounding=rounding)
