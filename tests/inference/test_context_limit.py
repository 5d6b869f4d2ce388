"""Prompts longer than the model's context: refused in one line, or cut at the start on request
(issue: a 21,560-token prompt on an 8,192-token model ran for minutes and printed garbage)."""

from __future__ import annotations

import pytest
from conftest import build, tiny_llama_config
from engine_toys import char_tokenizer

from kvgate.errors import KVGateError
from kvgate.inference.engine import Engine
from kvgate.models.limits import InputTooLongError, context_limit, fit_to_context


@pytest.fixture(scope="module")
def short_model():
    return build(tiny_llama_config(max_position_embeddings=24))


def test_context_limit_reads_max_position_embeddings(short_model):
    assert context_limit(short_model.config) == 24
    assert context_limit(object()) is None


def test_a_prompt_that_does_not_fit_is_refused_in_one_line(short_model):
    engine = Engine(short_model, char_tokenizer(), "full", 1.0)
    with pytest.raises(InputTooLongError) as err:
        engine.generate(["short", "x" * 30], max_new_tokens=4)
    msg = str(err.value)
    assert isinstance(err.value, KVGateError) and "\n" not in msg
    assert "prompt 1" in msg and "24" in msg and "--truncate" in msg


def test_new_tokens_count_against_the_context(short_model):
    engine = Engine(short_model, char_tokenizer(), "full", 1.0)
    n = len(engine.tokenizer("y" * 18)["input_ids"])
    assert n <= 24
    engine.generate(["y" * 18], max_new_tokens=24 - n)  # fits exactly
    with pytest.raises(InputTooLongError, match="new tokens"):
        engine.generate(["y" * 18], max_new_tokens=24 - n + 1)


def test_truncate_keeps_the_end_and_says_what_it_dropped(short_model, capsys):
    tok = char_tokenizer()
    engine = Engine(short_model, tok, "full", 1.0, truncate=True)
    prompt = "abcdefghij" * 4
    ids, mask = engine.encode([prompt, "ok"], reserve=4)
    full = tok(prompt)["input_ids"]
    assert ids.shape[1] == 20 and ids[0].tolist() == full[-20:]
    assert mask[1].sum() == len(tok("ok")["input_ids"])
    err = capsys.readouterr().err
    assert "prompt 0 cut to its last 20" in err and f"dropped {len(full) - 20}" in err


def test_fit_to_context_without_a_limit_changes_nothing():
    rows = [[1, 2, 3], [4]]
    assert fit_to_context(rows, None, reserve=100) == rows
    with pytest.raises(InputTooLongError, match="no room"):
        fit_to_context(rows, 8, reserve=8)


def test_the_tokenizers_own_length_warning_gives_way_to_the_models_check(short_model):
    """A real tokenizer warns on its own model_max_length (often not the model's); the Engine
    silences it, so a prompt that does not fit gets one line, ours."""
    tok = char_tokenizer()
    tok.model_max_length = 10
    Engine(short_model, tok, "full", 1.0)
    assert tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"]
