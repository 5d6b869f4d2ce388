"""Engine: generation equal to transformers' at full budget, real savings and stats under
eviction, prefill logits for evaluation code, clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_mistral_config
from engine_toys import EOS, PAD, char_tokenizer

from kvgate.inference import Engine
from kvgate.policies.base import PolicyError

PROMPTS = ["the cat sat on the mat", "hello", "a b c d e f g h i j k"]


@pytest.fixture(scope="module")
def llama():
    return build(tiny_llama_config())


def test_full_policy_matches_transformers_generate(llama):
    engine = Engine(llama, char_tokenizer(), "full", 1.0)
    result = engine.generate(PROMPTS, max_new_tokens=8)
    for prompt, ids in zip(PROMPTS, result.token_ids):
        enc = engine.tokenizer(prompt, return_tensors="pt")
        ref = llama.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                             pad_token_id=PAD)[0, enc["input_ids"].shape[1]:].tolist()
        assert ids == ref[:len(ids)]
        assert len(ids) == 8 or ids[-1] == EOS
    assert result.stats.kept_fraction == 1.0
    assert result.stats.prompt_tokens == [len(p) for p in PROMPTS]


def test_eviction_shrinks_the_cache_and_reports_it():
    model = build(tiny_mistral_config())
    engine = Engine(model, char_tokenizer(), "snapkv", 0.5, policy_options={"window": 4})
    result = engine.generate(PROMPTS, max_new_tokens=6)
    stats = result.stats
    assert 0.45 < stats.kept_fraction < 0.65  # ceil(0.5 x length) per head
    assert len(stats.kept_fraction_per_layer) == model.config.num_hidden_layers
    assert stats.bytes_held < 0.75 * stats.bytes_full
    assert stats.prefill_ms > 0 and stats.decode_tokens_per_s > 0
    assert stats.new_tokens == sum(len(t) for t in result.token_ids)
    table = stats.table()
    assert "KV bytes held" in table and "snapkv" in table
    assert len(result.texts) == 3 and all(isinstance(t, str) for t in result.texts)
    assert result.prompt_ids[1] == engine.tokenizer("hello")["input_ids"]


def test_prefill_logits_are_the_full_models_for_one_shot_policies(llama):
    engine = Engine(llama, char_tokenizer(), "snapkv", 0.3, policy_options={"window": 4})
    ids, mask = engine.encode(PROMPTS[:2])
    logits, cache = engine.prefill(ids, mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = llama(ids, attention_mask=mask, position_ids=positions).logits
    valid = mask.bool()
    torch.testing.assert_close(logits[valid], ref[valid], atol=1e-5, rtol=0)
    assert cache.kept_fraction() < 0.5


def test_sampling_is_reproducible_with_a_seed(llama):
    engine = Engine(llama, char_tokenizer(), "window", 0.5)
    a = engine.generate("sampling test", max_new_tokens=6, greedy=False, seed=3)
    b = engine.generate("sampling test", max_new_tokens=6, greedy=False, seed=3)
    assert a.token_ids == b.token_ids


def test_engine_errors_are_policy_errors(llama):
    tok = char_tokenizer()
    with pytest.raises(PolicyError, match="unknown policy"):
        Engine(llama, tok, "no_such_policy", 0.5)
    with pytest.raises(PolicyError, match="needs attention scores"):
        Engine(llama, tok, "h2o", 0.5, attn="flash")
    with pytest.raises(PolicyError, match="budget ratio"):
        Engine(llama, tok, "window", 1.5)
    engine = Engine(llama, tok, "window", 0.5, attn="flash")  # no scores needed: fine
    with pytest.raises(PolicyError, match="non-empty"):
        engine.generate([""])


@pytest.mark.parametrize("budget", [None, "half", [0.5], True])
def test_a_budget_that_is_not_a_number_is_a_policy_error(llama, budget):
    """Issue #46 case 5: ``Engine(..., budget=None)`` was a bare TypeError."""
    from kvgate.errors import KVGateError

    with pytest.raises(KVGateError, match="budget"):
        Engine(llama, char_tokenizer(), "snapkv", budget)
