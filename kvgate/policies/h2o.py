"""H2O, Heavy-Hitter Oracle: accumulated attention + a recent window.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
Zhang et al. 2023, arXiv:2306.14048. Rule: a few tokens ("heavy hitters") receive most of the
attention; keep the tokens with the largest attention summed over every query so far, plus the
most recent tokens, and keep accumulating (evicting the lowest sum) while decoding.

Score of key j = sum over every query row i >= j of A[i, j] (a column sum of the causal
matrix, no normalisation), per sample (the reference sums over the batch too, which is wrong
for batch > 1) and per query head, then aggregated over the GQA group (``gqa``, default mean).

Budget split ``B = heavy + recent``. ``recent`` is a float share of the budget or an int token
count. The default 0.5 is the equal split of the H2O scripts (heavy_ratio = recent_ratio);
with an odd budget the extra entry goes to the heavy set. LongBench-style baselines
(KVCache-Factory, Ada-KV, AhaKV) use ``recent=32``. ``allocation`` (``AllocationOption``):
``"head"`` or ``"global"`` (column sums divided by their per-(layer, head) sum).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvgate.policies.base import (
    AllocationOption,
    Budget,
    DecodeEvicting,
    LayerPrompt,
    ScoredPolicy,
    attention_sums,
    by_position,
    check_choice,
    check_decode,
    check_share,
    decode_probs,
    gqa_reduce,
    last_real,
    resolve_share,
    select_topk,
    stat,
)


@dataclass
class H2O(ScoredPolicy, DecodeEvicting, AllocationOption):
    """Prefill: top column sums outside the recent window + the window. Decode: keep
    accumulating every new row and evict the argmin outside the recent window."""

    recent: float | int = 0.5
    gqa: str = "mean"

    name = "h2o"
    column_sums = True  # the cache may hand them over from its prefill (one pass, no re-score)

    def __post_init__(self) -> None:
        self.check_allocation()
        check_share(self.name, "recent", self.recent)
        check_choice(self.name, "gqa", self.gqa, ("mean", "max"))

    def scores(self, prompt: LayerPrompt, budget: Budget | None = None) -> Tensor:
        """Column sums over all prompt rows ``[B, H_kv, n]`` (fp32, 0 at padding)."""
        sums = prompt.derived.get("column_sums")
        if sums is None:  # decode_init asks again after keep: computed once per layer call
            sums = attention_sums(prompt.query, prompt.key, prompt.valid, prompt.scaling,
                                  lse=prompt.lse)
            prompt.derived["column_sums"] = sums
        return gqa_reduce(sums, prompt.key.shape[1], self.gqa)

    def forced(self, prompt: LayerPrompt, kept: Tensor) -> Tensor:
        b, hk, n = prompt.key.shape[:3]
        return last_real(prompt.valid, resolve_share(self.recent, kept)).expand(b, hk, n)

    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        """``{"acc": [B, H_kv, n]}``: the prompt column sums the decode steps keep adding to."""
        return {"acc": self.scores(prompt)}

    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """Add the new rows' probabilities to ``acc``; keep the recent share of ``capacity``
        by position and the highest ``acc`` for the rest. Returns (stats, [B, H_kv, T])."""
        check_decode(logits, valid, positions, capacity)
        rows = gqa_reduce(decode_probs(logits).sum(2), valid.shape[1], self.gqa)
        acc = (stat(stats, "acc", valid) + rows).masked_fill(~valid, 0.0)
        recent = by_position(positions, valid, resolve_share(self.recent, capacity), newest=True)
        return {"acc": acc}, select_topk(acc, capacity, recent, valid)
