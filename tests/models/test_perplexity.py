"""Perplexity: batched and padded equals a direct per-sequence computation."""

import math

import pytest
import torch

from kvgate.models.perplexity import PerplexityError, perplexity


class CharTokenizer:
    """One token per character (ids < 128, the tiny models' vocabulary)."""

    def __call__(self, text):
        return {"input_ids": [ord(c) % 128 for c in text]}


TEXTS = ["the cat sat on the mat", "a", "hello world, this one is a good deal longer than the rest",
         "short text", "", "medium length sentence here"]


def direct_perplexity(model, texts, max_length):
    """exp(total NLL / total predicted tokens), one unpadded sequence at a time."""
    total, count = 0.0, 0
    for text in texts:
        ids = CharTokenizer()(text)["input_ids"][:max_length]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
        total -= logp.gather(1, x[0, 1:, None]).sum().item()
        count += len(ids) - 1
    return math.exp(total / count)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_matches_direct_computation(tiny_model, batch_size):
    got = perplexity(tiny_model, CharTokenizer(), TEXTS, max_length=512, batch_size=batch_size)
    assert got == pytest.approx(direct_perplexity(tiny_model, TEXTS, 512), rel=1e-5)


def test_truncates_each_text_to_max_length(tiny_llama):
    got = perplexity(tiny_llama, CharTokenizer(), TEXTS, max_length=7, batch_size=4)
    assert got == pytest.approx(direct_perplexity(tiny_llama, TEXTS, 7), rel=1e-5)
    assert got != pytest.approx(direct_perplexity(tiny_llama, TEXTS, 512), rel=1e-3)


def test_restores_training_mode(tiny_llama):
    tiny_llama.train()
    perplexity(tiny_llama, CharTokenizer(), TEXTS[:2])
    assert tiny_llama.training


@pytest.mark.parametrize("texts", [[], ["", "x"], "a single string"])
def test_nothing_to_score_is_a_clear_error(tiny_llama, texts):
    with pytest.raises(PerplexityError):
        perplexity(tiny_llama, CharTokenizer(), texts)
