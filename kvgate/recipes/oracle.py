"""The oracle objective: gates trained to predict what KVzip would keep.

Labels: the frozen base's KVzip (or KVzip+) scores of each training block, per layer, KV head
and token (``kvgate.data.oracle``; KVzip arXiv:2505.23416). The gate's raw score ``s`` (before
gamma and the sigmoid) of every entry it decides on is compared with them, in one of three
ways (``ORACLE_LOSSES``):

- ``mse_log``: KVzap's regression (arXiv:2601.07891): mean squared error between ``s`` and the
  log score. KVzap thresholds its prediction at a fixed log score; a gate keeps an entry when
  ``sigmoid(s + gamma) > tau``, i.e. ``s > logit(tau) - gamma``. The targets are therefore the
  log scores shifted, per block, so that this threshold falls where KVzip cuts at the keep
  ratio: the regression and the eviction loss then ask for the same retention;
- ``bce``: Fast KVzip's classification (arXiv:2601.17668): binary cross-entropy of the logit
  ``s - (logit(tau) - gamma)`` against "KVzip keeps it at the keep ratio";
- ``rank``: a pairwise logistic loss ``softplus(s_evicted - s_kept)`` on kept / evicted pairs
  drawn at random within a block: the order alone, the level left to the eviction loss.

"KVzip keeps it at the keep ratio" is one ranking per block over every gated layer and KV head
(``allocation=global``, kvpress's default): a gate's threshold is one level for all its heads,
and the issue's pilot found the global ranking far ahead of an equal share per head. The keep
ratio is ``recipe.oracle_keep``, or else the retention the eviction loss targets at this step.
Entries the gate does not decide on (padding, sinks, forced tokens, tokens past the labelled
context) take no part.

The gradient reaches only the gates' parameters: the scores come from ``GateRecord.scores``,
recomputed from each layer's input cut from its history (``kvgate.gate.apply.compute_gate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvgate.gate.loss import gate_records

PAIRS = 4096  # kept / evicted pairs drawn per block by the rank loss


def oracle_inputs(model: nn.Module, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The last forward's gate scores and their labels, aligned: ``(scores, targets, decided)``
    each ``[B, G, H, m]`` over the G gated layers and the first m tokens both cover (labels
    ``[B, L, H_kv, context]`` log scores; ``decided``: the entries the gate decides on)."""
    records = [(i, r) for i, r in gate_records(model) if r.scores is not None]
    if not records:
        raise RuntimeError("no gate scores recorded: run the forward inside "
                           "kvgate.gate.recorded_scores(model)")
    layers = [i for i, _ in records]
    first = records[0][1]
    m = min(first.scores.shape[-1], labels.shape[-1])
    scores = torch.stack([r.scores[..., :m] for _, r in records], 1)  # [B, G, H, m]
    targets = labels[:, layers, :, :m].to(scores.device, torch.float32)
    if targets.shape[2] != scores.shape[2]:
        raise RuntimeError(f"oracle labels have {targets.shape[2]} KV heads, the gates score "
                           f"{scores.shape[2]} heads")
    decided = (first.counted & ~first.forced)[:, None, None, :m].expand_as(scores)
    return scores, targets, decided


def keep_cut(targets: Tensor, decided: Tensor, keep: float) -> Tensor:
    """Per block, the lowest log score KVzip keeps when ``keep`` of the decided entries stay,
    ranked over all layers and heads at once: ``[B]`` (+inf for a block with none)."""
    b = targets.shape[0]
    flat = targets.masked_fill(~decided, math.inf).reshape(b, -1)
    count = decided.reshape(b, -1).sum(-1)  # [B]
    kept = (keep * count).round().long().clamp(min=1)
    first_kept = (count - kept).clamp(min=0)
    return flat.sort(-1).values.gather(-1, first_kept[:, None])[:, 0]


def mse_log_loss(s: Tensor, targets: Tensor, cut: Tensor, kept: Tensor, decided: Tensor,
                 threshold: float) -> Tensor:
    """KVzap's MSE on log scores, shifted so the gate's threshold sits at KVzip's cut."""
    shifted = targets - cut[:, None, None, None] + threshold
    return _mean((s - shifted.masked_fill(~decided, 0.0)) ** 2, decided)


def bce_loss(s: Tensor, targets: Tensor, cut: Tensor, kept: Tensor, decided: Tensor,
             threshold: float) -> Tensor:
    """Fast KVzip's BCE on keep labels, with the gate's threshold as the decision boundary."""
    bce = F.binary_cross_entropy_with_logits(s - threshold, kept.float(), reduction="none")
    return _mean(bce, decided)


def rank_loss(s: Tensor, targets: Tensor, cut: Tensor, kept: Tensor, decided: Tensor,
              threshold: float) -> Tensor:
    """Logistic loss on ``PAIRS`` random (kept, evicted) pairs per block."""
    b = s.shape[0]
    keep_w = (kept & decided).reshape(b, -1).float()
    drop_w = (~kept & decided).reshape(b, -1).float()
    both = (keep_w.sum(-1) > 0) & (drop_w.sum(-1) > 0)  # blocks with pairs to draw
    if not bool(both.any()):
        return s.sum() * 0.0
    flat = s.reshape(b, -1)[both]
    i = torch.multinomial(keep_w[both], PAIRS, replacement=True)
    j = torch.multinomial(drop_w[both], PAIRS, replacement=True)
    return F.softplus(flat.gather(-1, j) - flat.gather(-1, i)).mean()


def _mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


# the explicit registry of ``recipe.oracle_loss``
ORACLE_LOSSES: dict[str, Callable[..., Tensor]] = {
    "mse_log": mse_log_loss, "bce": bce_loss, "rank": rank_loss,
}


def oracle_loss(model: nn.Module, labels: Tensor, kind: str, keep: float, gamma: float,
                tau: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The oracle loss ``kind`` of the last forward (run inside ``recorded_scores``) against
    ``labels`` ``[B, L, H_kv, context]`` (log KVzip scores), and ``agreement``: the share of
    decided entries on which the gate's keep flag and KVzip's at ``keep`` agree."""
    if kind not in ORACLE_LOSSES:
        raise ValueError(f"oracle loss {kind!r}: known {list(ORACLE_LOSSES)}")
    s, targets, decided = oracle_inputs(model, labels)
    cut = keep_cut(targets, decided, keep)
    kept = targets >= cut[:, None, None, None]
    threshold = math.log(tau / (1.0 - tau)) - gamma  # keep <=> s > threshold
    loss = ORACLE_LOSSES[kind](s, targets, cut, kept, decided, threshold)
    with torch.no_grad():
        agreement = _mean(((s > threshold) == kept).float(), decided)
    return loss, {"agreement": agreement}


__all__ = ["ORACLE_LOSSES", "PAIRS", "bce_loss", "keep_cut", "mse_log_loss", "oracle_inputs",
           "oracle_loss", "rank_loss"]
