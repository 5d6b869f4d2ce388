"""Masked-mode scoring: equals a direct forward for `full`, equals the compressed cache for
one-shot policies, and counts %Evict per spec 12.3 (iv)."""

import math

import pytest
import torch
from eval_fakes import direct_loglik, random_items

from kvgate.eval.errors import EvalError
from kvgate.eval.masked import ScoringItem, keep_for_rows, masked_scores
from kvgate.eval.multiple_choice import cache_scores
from kvgate.gate import GateConfig, patch, prompt_segment
from kvgate.policies import Budget, get_policy
from kvgate.policies.base import LayerPrompt

HALF = Budget(ratio=0.5)


def _lls(scores):
    return [x for s in scores for x in s.loglik]


def test_full_matches_direct_loglikelihood(tiny_model):
    items = random_items(4)
    scores, _ = masked_scores(tiny_model, items, get_policy("full"), [HALF] * 4)
    want = [direct_loglik(tiny_model, it.context, ch) for it in items for ch in it.choices]
    assert _lls(scores) == pytest.approx(want, abs=1e-4)
    assert [s.tokens for s in scores] == [[len(c) for c in it.choices] for it in items]
    assert all(s.kept == s.total and s.evict == 0.0 for s in scores)


def test_choices_packed_in_one_row_do_not_see_each_other(tiny_llama):
    item = random_items(1, seed=3)[0]
    packed, _ = masked_scores(tiny_llama, [item], get_policy("window"), [HALF])
    alone = [masked_scores(tiny_llama, [ScoringItem("x", item.context, (ch,))],
                           get_policy("window"), [HALF])[0][0].loglik[0] for ch in item.choices]
    assert packed[0].loglik == pytest.approx(alone, abs=1e-4)


@pytest.mark.parametrize("name,opts", [
    ("full", {}), ("window", {}), ("streaming", {"sinks": 2}), ("snapkv", {"window": 4}),
    ("h2o", {}), ("tova", {}), ("adakv", {"inner_options": {"window": 4}}), ("nacl", {}),
])
def test_masked_equals_compressed_cache(tiny_model, name, opts):
    items = random_items(4, seed=2)
    policy = get_policy(name, **opts)
    masked, _ = masked_scores(tiny_model, items, policy, [HALF] * 4)
    cached = cache_scores(tiny_model, items, policy, HALF)
    assert _lls(masked) == pytest.approx(_lls(cached), abs=2e-5)
    assert [s.kept for s in masked] == [s.kept for s in cached]
    assert [s.total for s in masked] == [s.total for s in cached]
    if name != "full":  # eviction really changed the scores, so agreement means something
        full, _ = masked_scores(tiny_model, items, get_policy("full"), [HALF] * 4)
        assert max(abs(a - b) for a, b in zip(_lls(masked), _lls(full))) > 1e-3


def test_snapkv_half_budget_evicts_half(tiny_llama):
    items = random_items(5, seed=4)
    scores, _ = masked_scores(tiny_llama, items, get_policy("snapkv", window=4), [HALF] * 5)
    for it, s in zip(items, scores):
        n = len(it.context)
        assert s.n_ctx == n
        assert s.total == 2 * 2 * n  # layers x KV heads x real context tokens
        assert s.evict == pytest.approx((n - math.ceil(n / 2)) / n)
    mean = 100 * sum(s.evict for s in scores) / len(scores)
    assert mean == pytest.approx(50.0, abs=100 / (2 * min(len(it.context) for it in items)))


def test_recorded_keep_masks_match_counts(tiny_llama):
    items = random_items(3, seed=5)
    scores, keeps = masked_scores(tiny_llama, items, get_policy("h2o"), [HALF] * 3, record=True)
    for it, s, keep in zip(items, scores, keeps):
        assert keep.shape == (2, 2, len(it.context))
        assert int(keep.sum()) == s.kept


def test_per_row_budgets_equal_separate_calls(tiny_llama):
    items = random_items(3, seed=6)
    budgets = [Budget(ratio=0.3), Budget(ratio=0.8), Budget(ratio=0.3)]
    policy = get_policy("snapkv", window=2)
    together, _ = masked_scores(tiny_llama, items, policy, budgets)
    apart = [masked_scores(tiny_llama, [it], policy, [b])[0][0] for it, b in zip(items, budgets)]
    assert _lls(together) == pytest.approx(_lls(apart), abs=1e-4)
    assert [s.kept for s in together] == [s.kept for s in apart]


def test_keep_for_rows_groups_by_budget():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 10, 8, generator=g), torch.randn(3, 2, 10, 8, generator=g)
    prompt = LayerPrompt(0, 2, q, k, k.clone(), torch.ones(3, 10, dtype=torch.bool), 0.35)
    keep = keep_for_rows(get_policy("window"), prompt, [Budget(ratio=0.2), Budget(ratio=0.6),
                                                        Budget(ratio=0.2)])
    assert keep.sum((1, 2)).tolist() == [2 * 2, 2 * 6, 2 * 2]


@pytest.mark.parametrize("config", [
    GateConfig(gamma=0.0),
    GateConfig(gamma=0.0, mode="prompt_bidirectional", sinks=1),
    GateConfig(gamma=0.0, ungated_layers=1),
])
def test_learned_gate_masked_equals_cache(tiny_model, config):
    torch.manual_seed(3)
    patch(tiny_model, config)
    items = random_items(3, seed=7)
    policy = get_policy("attention_gate")
    masked, _ = masked_scores(tiny_model, items, policy, [HALF] * 3)
    cached = cache_scores(tiny_model, items, policy, HALF)
    assert _lls(masked) == pytest.approx(_lls(cached), abs=2e-5)
    assert [s.kept for s in masked] == [s.kept for s in cached]
    assert 0.05 < sum(s.evict for s in masked) / 3 < 0.95  # the random gate really evicts


def test_learned_gate_full_prefill_masked_equals_cache(tiny_model):
    """prefill="full" (the gate as a one-shot policy): masked mode still equals the real cache,
    and it scores differently from the paper's in-prefill eviction with the same flags' gate."""
    torch.manual_seed(3)
    patch(tiny_model, GateConfig(gamma=0.0))
    items = random_items(3, seed=7)
    one_shot = get_policy("attention_gate", prefill="full")
    masked, _ = masked_scores(tiny_model, items, one_shot, [HALF] * 3)
    cached = cache_scores(tiny_model, items, one_shot, HALF)
    assert _lls(masked) == pytest.approx(_lls(cached), abs=2e-5)
    assert [s.kept for s in masked] == [s.kept for s in cached]
    gated, _ = masked_scores(tiny_model, items, get_policy("attention_gate"), [HALF] * 3)
    assert max(abs(a - b) for a, b in zip(_lls(masked), _lls(gated))) > 1e-3


def _training_forward_loglik(model, item):
    """Log-likelihood of the item's one choice from the gated model's own (training-time)
    forward over context + choice, with the context marked as the prompt."""
    ctx, ch = list(item.context), list(item.choices[0])
    ids = torch.tensor([ctx + ch])
    prompt = torch.tensor([[True] * len(ctx) + [False] * len(ch)])
    with torch.no_grad(), prompt_segment(model, prompt):
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(ch))


def test_learned_gate_masked_equals_training_forward(tiny_llama):
    """The gated model's own (training-time) forward over context + one choice, with the gate
    bidirectional over the context and choice tokens never gated, is masked mode."""
    torch.manual_seed(4)
    patch(tiny_llama, GateConfig(gamma=0.0, mode="prompt_bidirectional"))
    item = random_items(1, seed=8, choices=1, lo=12, hi=13)[0]
    masked, _ = masked_scores(tiny_llama, [item], get_policy("attention_gate"), [HALF])
    assert masked[0].loglik[0] == pytest.approx(_training_forward_loglik(tiny_llama, item), abs=1e-4)
    assert masked[0].evict > 0


@pytest.mark.parametrize("recent,mode", [(0, "causal"), (2, "causal"),
                                         (2, "prompt_bidirectional")])
def test_full_prefill_gate_masked_equals_training_forward(tiny_llama, recent, mode):
    """A gate trained one-shot (``GateConfig.prefill="full"``) is run one-shot by default, and
    masked-mode scoring of context + one choice is exactly its training forward with the context
    as the prompt: what it trains on is what it is measured on (also when the gate reads the
    whole prompt before flagging)."""
    torch.manual_seed(5)
    patch(tiny_llama, GateConfig(gamma=0.0, prefill="full", recent=recent, mode=mode))
    item = random_items(1, seed=9, choices=1, lo=12, hi=13)[0]
    policy = get_policy("attention_gate")
    masked, _ = masked_scores(tiny_llama, [item], policy, [HALF])
    attn = next(m for m in tiny_llama.modules() if hasattr(m, "kv_gate"))
    prompt = LayerPrompt(0, 1, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2),
                         torch.zeros(1, 1, 2, 2), torch.ones(1, 2, dtype=torch.bool), 1.0,
                         torch.zeros(1, 2, 4), attn, (torch.ones(1, 2, 2), torch.zeros(1, 2, 2)))
    assert policy.encode_band(prompt) is None  # one-shot: the prefill attends fully
    assert masked[0].loglik[0] == pytest.approx(_training_forward_loglik(tiny_llama, item), abs=1e-4)
    assert masked[0].evict > 0


def test_one_budget_per_item_is_required(tiny_llama):
    with pytest.raises(EvalError, match="one budget per item"):
        masked_scores(tiny_llama, random_items(2), get_policy("full"), [HALF])


def test_bad_items_are_refused():
    with pytest.raises(EvalError, match="context has no tokens"):
        ScoringItem("x", (), ((1,),))
    with pytest.raises(EvalError, match="choice"):
        ScoringItem("x", (1,), ((),))
