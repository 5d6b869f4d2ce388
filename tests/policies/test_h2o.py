import pytest
import torch
from policy_testing import kept_positions, make_prompt, prompt_from_attention

from kvgate.policies import H2O, Budget, PolicyError
from kvgate.policies import sums as policy_sums
from kvgate.policies.base import causal_probs

SPEC_A = [[[1, 0, 0, 0], [.5, .5, 0, 0], [.6, .1, .3, 0], [.4, .1, .1, .4]]]


def test_spec_hand_check_column_sums_and_keep():
    prompt = prompt_from_attention(SPEC_A)
    scores = H2O().scores(prompt)
    assert torch.allclose(scores[0, 0], torch.tensor([2.5, .7, .4, .4]), atol=1e-5)
    assert kept_positions(H2O(recent=1).keep(prompt, Budget(tokens=2))) == {0, 3}


def test_default_is_an_equal_split_with_the_extra_entry_heavy():
    policy, prompt = H2O(), make_prompt(lengths=(24,))
    keep = policy.keep(prompt, Budget(tokens=9))
    assert keep[0, :, -4:].all()  # floor(0.5 * 9) = 4 recent
    scores = policy.scores(prompt)[0]
    for h in range(2):
        heavy = keep[0, h, :20]
        assert heavy.sum() == 5
        assert scores[h, :20][heavy].min() > scores[h, :20][~heavy].max()


def test_column_sums_match_the_full_matrix_across_row_chunks(monkeypatch):
    prompt = make_prompt(heads=4, kv_heads=2)
    monkeypatch.setattr(policy_sums, "ROW_CHUNK_ELEMS", 3 * 2 * 4 * 24)  # 3 rows per chunk
    chunked = H2O(gqa="max").scores(prompt)
    full = causal_probs(prompt.query, prompt.key, prompt.valid, prompt.scaling).sum(2)
    assert torch.allclose(chunked, full.view(2, 2, 2, 24).amax(2), atol=1e-5)


def test_decode_accumulates_and_evicts_the_argmin_outside_the_recent_window():
    policy = H2O(recent=1)
    stats = {"acc": torch.tensor([[[2.5, .4, 0.0]]])}  # prompt kept {0, 3}, new token 4
    positions = torch.tensor([[[0, 3, 4]]])
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    logits = torch.log(torch.tensor([.5, .2, .3])).view(1, 1, 1, 3)
    stats, keep = policy.decode_select(stats, logits, valid, positions, torch.full((1, 1), 2))
    assert torch.allclose(stats["acc"], torch.tensor([[[3.0, .6, .3]]]), atol=1e-6)
    assert keep.flatten().tolist() == [True, False, True]


def test_decode_keeps_recent_tokens_and_the_budget():
    policy = H2O(recent=2)
    stats = policy.decode_init(make_prompt(lengths=(12,)), None)
    acc = stats["acc"]
    positions = torch.arange(12).expand(1, 2, 12)
    capacity = torch.full((1, 2), 6)
    for step in range(12, 20):
        acc = torch.cat([acc, torch.zeros(1, 2, 1)], dim=-1)
        positions = torch.cat([positions, torch.full((1, 2, 1), step)], dim=-1)
        valid = torch.ones_like(positions, dtype=torch.bool)
        logits = torch.randn(1, 4, 1, positions.shape[-1]) * 3
        new, keep = policy.decode_select({"acc": acc}, logits, valid, positions, capacity)
        assert keep[..., -2:].all()
        assert (keep.sum(-1) == torch.minimum(capacity, valid.sum(-1))).all()
        acc, positions = new["acc"][keep].view(1, 2, -1), positions[keep].view(1, 2, -1)


def test_recent_option_is_validated():
    with pytest.raises(PolicyError, match="h2o.recent"):
        H2O(recent=1.5)
    with pytest.raises(PolicyError, match="h2o.recent"):
        H2O(recent=-2)


def test_attention_and_its_column_sums_in_one_pass(monkeypatch):
    """The one-pass prefill (``attention_with_sums``, row chunks of 3) gives SDPA's causal
    output and the column sums of the full probability matrix."""
    prompt = make_prompt(heads=4, kv_heads=2, lengths=(24,))
    monkeypatch.setattr(policy_sums, "ROW_CHUNK_ELEMS", 3 * 4 * 24)
    out, sums = policy_sums.attention_with_sums(prompt.query, prompt.key, prompt.value,
                                                prompt.scaling)
    ref = torch.nn.functional.scaled_dot_product_attention(
        prompt.query, prompt.key.repeat_interleave(2, 1), prompt.value.repeat_interleave(2, 1),
        is_causal=True, scale=prompt.scaling)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    full = causal_probs(prompt.query, prompt.key, prompt.valid, prompt.scaling).sum(2)
    torch.testing.assert_close(sums, full, atol=1e-5, rtol=1e-5)
    assert sums.std() > 0.1  # not a uniform matrix


def test_the_cache_hands_h2o_the_sums_of_its_own_prefill(monkeypatch):
    """CompressedCache on the CPU: H2O's scores come from the prefill's one pass and keep
    exactly what H2O keeps scoring the prompt itself; the prefill's output is the model's."""
    from conftest import build, tiny_llama_config

    from kvgate.cache import CompressedCache
    from kvgate.cache.prefill import causal_attention_sums

    model = build(tiny_llama_config())
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    seen = []
    original = H2O.scores

    def spy(self, prompt, budget=None):
        seen.append("column_sums" in prompt.derived)
        return original(self, prompt, budget)

    monkeypatch.setattr(H2O, "scores", spy)
    cache = CompressedCache(model, H2O(), 0.5)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        ref = model(ids).logits
    monkeypatch.undo()
    assert seen and all(seen)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    prompt = make_prompt(heads=4, kv_heads=2, lengths=(30,))
    two_pass = H2O().keep(prompt, Budget(ratio=0.5))
    _, prompt.derived["column_sums"] = causal_attention_sums(
        prompt.query, prompt.key, prompt.value, None, prompt.valid, prompt.scaling, None)
    assert torch.equal(H2O().keep(prompt, Budget(ratio=0.5)), two_pass)
