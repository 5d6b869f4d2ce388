"""Compress once, ask many: the policy never sees a question, forks are independent, a batch of
contexts equals them one by one, and the chat split writes the template's own text."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_mistral_config
from engine_toys import char_tokenizer
from infer_fixtures import fake_base

from kvgate.cache.fork import fork_cache
from kvgate.inference import Engine
from kvgate.inference.compress import SEPARATOR, answer_all, split_prompt
from kvgate.policies import get_policy
from kvgate.policies.base import PolicyError

CONTEXTS = ["the cat sat on the mat and the dog lay by the door.",
            "alpha beta gamma delta",
            "one two three four five six seven eight nine ten eleven"]
QUESTIONS = ["where is the cat?", "who lay by the door?", "what is it?"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama():
    return build(tiny_llama_config())


@pytest.fixture(scope="module")
def mistral():
    return build(tiny_mistral_config())


def recording(name: str, **options):
    """A registered policy whose ``keep`` calls are recorded: (prompt length, keep mask)."""
    base = type(get_policy(name, **options))
    calls: list[tuple[int, torch.Tensor]] = []

    class Recording(base):
        def keep(self, prompt, budget):
            keep = super().keep(prompt, budget)
            calls.append((prompt.key.shape[2], keep.clone()))
            return keep

    return Recording(**options), calls


def test_policy_never_sees_the_question(llama):
    policy, calls = recording("snapkv", window=4)
    engine = Engine(llama, chat_tokenizer(), policy, 0.5)
    masks = []
    for question in QUESTIONS[:2]:  # a fresh compression per question
        compressed = engine.compress(CONTEXTS[0])
        n = compressed.input_ids.shape[1]
        engine.answer(compressed, [question], max_new_tokens=4)
        assert [m for m, _ in calls] == [n] * llama.config.num_hidden_layers  # context only
        masks.append([k for _, k in calls])
        calls.clear()
    assert all(torch.equal(a, b) for a, b in zip(*masks))
    engine.answer(compressed, QUESTIONS, max_new_tokens=4)
    assert calls == []  # answering never runs the policy's prefill again


@pytest.mark.parametrize("policy, options, chat", [("snapkv", {"window": 4}, True),
                                                   ("h2o", {}, False), ("streaming", {}, True)])
def test_compress_once_equals_fresh_compression_per_question(mistral, policy, options, chat):
    engine = Engine(mistral, chat_tokenizer(), policy, 0.5, policy_options=options)
    compressed = engine.compress(CONTEXTS[0], chat=chat)
    held = [layer.store.keys.clone() for layer in compressed.cache.layers]
    _, once = answer_all(engine, compressed, [QUESTIONS], max_new_tokens=6, answer_prefix="A:")
    for question, ids in zip(QUESTIONS, once[0]):
        fresh = engine.compress(CONTEXTS[0], chat=chat)
        _, again = answer_all(engine, fresh, [[question]], max_new_tokens=6, answer_prefix="A:")
        assert again[0][0] == ids
    # the compressed cache itself was not touched by the answers
    assert all(torch.equal(a, layer.store.keys) for a, layer in zip(held, compressed.cache.layers))
    assert compressed.cache.layers[0].seen == compressed.input_ids.shape[1]


def test_full_cache_answer_equals_generate_on_the_whole_prompt(llama):
    """Positions and masks of the continuation are right: with nothing evicted, compress +
    answer is exactly one generate over context part + question part (char tokenizer)."""
    tok = chat_tokenizer()
    engine = Engine(llama, tok, "full", 1.0)
    compressed = engine.compress(CONTEXTS)
    _, ids = answer_all(engine, compressed, [[q] for q in QUESTIONS], max_new_tokens=8)
    prompts = ["".join(split_prompt(tok, c, q)) for c, q in zip(CONTEXTS, QUESTIONS)]
    ref = engine.generate(prompts, max_new_tokens=8)
    assert [row[0] for row in ids] == ref.token_ids


@pytest.mark.parametrize("policy, options", [("snapkv", {"window": 4}), ("h2o", {}),
                                             ("tova", {})])
def test_batch_of_contexts_equals_one_by_one(llama, policy, options):
    engine = Engine(llama, chat_tokenizer(), policy, 0.5, policy_options=options)
    batch = engine.compress(CONTEXTS)
    texts = engine.answer(batch, QUESTIONS, max_new_tokens=6)
    _, batch_ids = answer_all(engine, batch, [[q] for q in QUESTIONS], max_new_tokens=6)
    for context, question, text, ids in zip(CONTEXTS, QUESTIONS, texts, batch_ids):
        single = engine.compress(context)
        _, alone = answer_all(engine, single, [[question]], max_new_tokens=6)
        assert alone[0][0] == ids[0]
        assert engine.answer(single, [question], max_new_tokens=6) == [text]
    assert len(batch.lengths) == 3 and 0.4 < batch.kept_fraction < 0.7


def test_several_questions_per_context_in_a_batch(llama):
    engine = Engine(llama, char_tokenizer(), "snapkv", 0.5, policy_options={"window": 4})
    batch = engine.compress(CONTEXTS[:2])
    texts, ids = answer_all(engine, batch, [QUESTIONS, QUESTIONS[:1]], max_new_tokens=4)
    assert [len(t) for t in texts] == [3, 1]
    first = engine.compress(CONTEXTS[0])
    assert answer_all(engine, first, [QUESTIONS], max_new_tokens=4)[1][0] == ids[0]


def test_chat_split_reproduces_the_template_exactly():
    tok = chat_tokenizer()
    context, question = CONTEXTS[0], QUESTIONS[0]
    ctx, q = split_prompt(tok, context, question, answer_prefix="Answer:")
    full = tok.apply_chat_template([{"role": "user", "content": context + SEPARATOR + question}],
                                   add_generation_prompt=True, tokenize=False)
    assert ctx + q == full + "Answer:"
    assert ctx.endswith(context + SEPARATOR) and question not in ctx
    plain = split_prompt(tok, context, question, chat=False)
    assert plain == (context, SEPARATOR + question)


def test_chat_split_on_smollm2_template():
    from kvgate.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    context, question = "A long document.\nIt has lines.", "What does it have?"
    ctx, q = split_prompt(tok, context, question, answer_prefix="It has")
    full = tok.apply_chat_template([{"role": "user", "content": context + SEPARATOR + question}],
                                   add_generation_prompt=True, tokenize=False)
    assert ctx + q == full + "It has"
    assert q.startswith(question) and "<|im_start|>assistant\n" in q and ctx.endswith(SEPARATOR)


def test_fork_is_independent(llama):
    engine = Engine(llama, char_tokenizer(), "h2o", 0.5)
    compressed = engine.compress(CONTEXTS[0])
    twin = fork_cache(compressed.cache)
    assert twin.layers[0].store is not compressed.cache.layers[0].store
    assert twin.layers[0].store.keys is compressed.cache.layers[0].store.keys  # shared K/V
    engine.answer(compressed, QUESTIONS[:1], max_new_tokens=3)
    assert twin.layers[0].seen == compressed.cache.layers[0].seen


def test_errors(llama):
    engine = Engine(llama, char_tokenizer(), "snapkv", 0.5, policy_options={"window": 4})
    with pytest.raises(PolicyError, match="non-empty"):
        engine.compress([])
    batch = engine.compress(CONTEXTS[:2])
    with pytest.raises(PolicyError, match="one question each"):
        engine.answer(batch, QUESTIONS, max_new_tokens=2)
    from kvgate.models.limits import InputTooLongError

    with pytest.raises(InputTooLongError, match="at most 256"):
        engine.answer(engine.compress(CONTEXTS[0]), ["x" * 300], max_new_tokens=2)


@pytest.fixture
def tiny_base(monkeypatch):
    return fake_base(monkeypatch, chat_tokenizer)


def test_cli_context_file_and_questions(tiny_base, capsys, tmp_path):
    import json

    from kvgate.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text(CONTEXTS[0])
    argv = ["infer", "--model", "tiny", "--policy", "snapkv", "--budget", "0.5",
            "--policy-opt", "window=4", "--context-file", str(doc), "--question", QUESTIONS[0],
            "--question", QUESTIONS[1], "--answer-prefix", "A:", "--max-new-tokens", "4"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    engine = Engine(build(tiny_llama_config()), chat_tokenizer(), "snapkv", 0.5,
                    policy_options={"window": 4})
    compressed = engine.compress(CONTEXTS[0])
    assert data["answers"] == engine.answer(compressed, QUESTIONS[:2], 4, answer_prefix="A:")
    assert data["stats"]["chat"] and data["stats"]["context_tokens"] == compressed.lengths[0]
    assert main(argv + ["--no-chat"]) == 0
    out = capsys.readouterr().out
    assert f"Q: {QUESTIONS[1]}" in out and "KV bytes held" in out and "chat template: no" in out


@pytest.mark.parametrize("extra, message", [
    (["--question", "q"], "need --context-file"),
    (["--context-file", "MISSING"], "no such file"),
])
def test_cli_errors_exit_2(tiny_base, capsys, extra, message):
    from kvgate.cli import main

    argv = ["infer", "--model", "tiny"] + (["--prompt", "hi"] if "--question" in extra else [])
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert tiny_base == []


def test_compress_shared_equals_each_policy_alone(llama):
    """One prefill for several policies (a batch of contexts): each result answers exactly as
    ``Engine(policy).compress`` does, holds the same share, and says what it cost."""
    from kvgate.inference.compress import compress_shared

    tok = chat_tokenizer()
    variants = {"snap": (get_policy("snapkv", window=4), 0.5), "h2o": (get_policy("h2o"), 0.25),
                "full": (get_policy("full"), 1.0)}
    engine = Engine(llama, tok, "full", 1.0)
    got, own = compress_shared(engine, CONTEXTS, variants)
    assert set(got) == set(own) == set(variants)
    for name, (policy, budget) in variants.items():
        alone = Engine(llama, tok, policy, budget).compress(CONTEXTS)
        assert got[name].kept_fraction == alone.kept_fraction
        assert got[name].bytes_held == alone.bytes_held and got[name].compress_ms > 0
        _, ids = answer_all(engine, got[name], [[q] for q in QUESTIONS], max_new_tokens=6)
        _, want = answer_all(engine, alone, [[q] for q in QUESTIONS], max_new_tokens=6)
        assert ids == want, name
    assert got["h2o"].kept_fraction < got["snap"].kept_fraction < got["full"].kept_fraction


@pytest.mark.parametrize("policy, options", [("snapkv", {"window": 4}),
                                             ("adakv", {"inner_options": {"window": 4}})])
def test_fixed_shape_decode_gives_the_same_tokens(llama, policy, options):
    """``graphs=True`` (on the CPU: the fixed-shape step run eagerly) generates and answers
    exactly what the growing cache does, over ragged heads (Ada-KV) and a left-padded batch."""
    plain = Engine(llama, char_tokenizer(), policy, 0.5, policy_options=options)
    fixed = Engine(llama, char_tokenizer(), policy, 0.5, policy_options=options, graphs=True)
    want = plain.generate(CONTEXTS, max_new_tokens=6).token_ids
    assert fixed.generate(CONTEXTS, max_new_tokens=6).token_ids == want
    squeezed = plain.compress(CONTEXTS[:2], chat=False)
    want = plain.answer(squeezed, QUESTIONS[:2], max_new_tokens=5)
    assert fixed.answer(squeezed, QUESTIONS[:2], max_new_tokens=5) == want
    with pytest.raises(PolicyError, match="evicts while decoding"):
        Engine(llama, char_tokenizer(), "h2o", 0.5, graphs=True)
