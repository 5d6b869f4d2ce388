"""The quantized cache (``kv_bits`` 8 / 4) through the engine: every policy and gate runs on it,
compress once / answer many keeps the compressed context intact, one shared prefill gives each
variant the cache its own quantized run holds, and ``kvgate infer --kv-bits`` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config, tiny_mistral_config
from engine_toys import char_tokenizer
from infer_fixtures import cli_fixture, tiny_base_fixture  # noqa: F401 - cli, tiny_base

from kvgate.cache.errors import CacheError
from kvgate.cache.rows import PlainRows, QuantRows
from kvgate.gate import GateConfig, patch, unpatch
from kvgate.inference import Engine
from kvgate.inference.compress import compress_shared
from kvgate.policies import get_policy, list_policies, policy_class
from kvgate.policies.contract import PassScoring, StreamingPrefill

KV = {"kv_bits": 4, "kv_group": 8, "kv_residual": 4}
PROMPTS = ["the cat sat on the mat and the dog lay by the door, quietly.",
           "alpha beta gamma delta epsilon"]
GATES = {"attention_gate", "local_gate", "gate_rank"}  # gate_rank ranks a local gate's scores
SMALL = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}, "ahakv": {"recent": 4},
         "adakv": {"inner_options": {"window": 4}}, "roco": {"block": 4}, "gate_rank": {"window": 4}}


@pytest.fixture(scope="module")
def models():
    return {"llama": build(tiny_llama_config()),
            "mistral": build(tiny_mistral_config(num_key_value_heads=2))}  # a sliding window


def _gated(model, name):
    torch.manual_seed(0)
    if name in ("local_gate", "gate_rank"):
        patch_evicting(model, "mlp")
    else:
        patch(model, GateConfig(gamma=0.0, tau=0.5))


# extra passes (KVzip) over a sliding-window layer are refused at any kv_bits: Mistral runs
# every other policy
CASES = [(family, name) for family in ("llama", "mistral") for name in list_policies()
         if not (family == "mistral" and issubclass(policy_class(name), PassScoring))]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_every_policy_and_gate_runs_on_the_quantized_cache(models, family, name):
    cls = policy_class(name)
    model = models[family]
    if name in GATES:
        _gated(model, name)
    try:
        runs = {}
        for kv in ({}, KV):
            engine = Engine(model, char_tokenizer(), get_policy(name, **SMALL.get(name, {})),
                            0.5, **kv)
            runs[bool(kv)] = engine.generate(PROMPTS, max_new_tokens=6)
    finally:
        if name in GATES:
            unpatch(model)
    full, quant = runs[False].stats, runs[True].stats
    assert quant.new_tokens > 0 and quant.kv == "4-bit, groups of 8, residual 4"
    assert quant.bytes_held < 0.8 * full.bytes_held
    if not issubclass(cls, (PassScoring, StreamingPrefill)):
        # the prefill attends over the prompt as the model gave it: the same choice
        assert quant.kept_fraction_per_layer == full.kept_fraction_per_layer


def _rows_of(cache):
    return [[t.clone() for t in layer.store.rows.tensors()] for layer in cache.layers]


def test_compress_once_answer_many_leaves_the_context_as_it_was():
    model = build(tiny_llama_config())
    engine = Engine(model, char_tokenizer(), get_policy("h2o", recent=0.5), 0.5, **KV)
    compressed = engine.compress(PROMPTS[0], chat=False)
    assert all(isinstance(layer.store.rows, QuantRows) for layer in compressed.cache.layers)
    held, before = compressed.bytes_held, _rows_of(compressed.cache)
    first = engine.answer(compressed, ["where is the cat?", "who lay by the door?"], 12)
    again = engine.answer(compressed, ["where is the cat?"], 12)
    assert first[0] == again[0]
    after = _rows_of(compressed.cache)
    assert all(torch.equal(a, b) for la, lb in zip(before, after) for a, b in zip(la, lb))
    assert compressed.cache.bytes_held() == held
    plain = Engine(model, char_tokenizer(), get_policy("h2o", recent=0.5), 0.5)
    assert held < plain.compress(PROMPTS[0], chat=False).bytes_held


def test_a_shared_prefill_gives_each_variant_its_own_quantized_cache():
    model = build(tiny_llama_config())
    variants = {"snap": (get_policy("snapkv", window=4), 0.5),
                "knorm": (get_policy("knorm"), 0.3)}
    engine = Engine(model, char_tokenizer(), "full", 1.0, **KV)
    shared, seconds = compress_shared(engine, PROMPTS[:1], variants, chat=False)
    assert set(seconds) == set(variants)
    for name, (policy, budget) in variants.items():
        alone = Engine(model, char_tokenizer(), policy, budget, **KV).compress(PROMPTS[0],
                                                                              chat=False)
        got = shared[name]
        assert got.cache.kv == alone.cache.kv and got.bytes_held == alone.bytes_held
        for a, b in zip(_rows_of(got.cache), _rows_of(alone.cache)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        q = ["where is the cat?"]
        assert engine.answer(got, q, 8) == Engine(model, char_tokenizer(), policy, budget,
                                                  **KV).answer(alone, q, 8)
    plain = Engine(model, char_tokenizer(), "full", 1.0)
    unquantized, _ = compress_shared(plain, PROMPTS[:1], variants, chat=False)
    assert isinstance(unquantized["snap"].cache.layers[0].store.rows, PlainRows)


def test_fixed_shape_decode_reads_the_quantized_cache_dequantized():
    """graphs=True freezes the cache after the prefill (its base dequantized once): the same
    tokens as eager decode over the quantized cache, while no flush of the tail intervenes."""
    model = build(tiny_llama_config())
    outs = [Engine(model, char_tokenizer(), get_policy("snapkv", window=4), 0.5, graphs=graphs,
                   **KV).generate(PROMPTS, max_new_tokens=12) for graphs in (False, True)]
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].stats.bytes_held == outs[1].stats.bytes_held  # written back, then counted


def test_engine_refuses_bad_settings_in_one_line():
    model = build(tiny_llama_config())
    with pytest.raises(CacheError, match="kv_bits must be 16, 8 or 4, got 6"):
        Engine(model, char_tokenizer(), "full", 1.0, kv_bits=6)
    with pytest.raises(CacheError, match="kv_group 5 does not split heads of 16 channels"):
        Engine(model, char_tokenizer(), "full", 1.0, kv_bits=8, kv_group=5)


# --------------------------------------------------------------------------- kvgate infer


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "3"], "--kv-bits must be 16, 8 or 4, got 3"),
    (["--kv-bits", "8", "--kv-group", "0"], "--kv-group must be an int >= 1, got 0"),
    (["--kv-residual", "-2"], "--kv-residual must be an int >= 0, got -2"),
])
def test_bad_kv_flags_exit_2_with_one_line(cli, tiny_base, capsys, argv, message):
    code = cli.main(["--model", "tiny", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert tiny_base == []  # refused before any model was loaded


def test_infer_with_kv_bits_prints_the_storage(cli, tiny_base, capsys, tmp_path):
    argv = ["--model", "tiny", "--policy", "snapkv", "--budget", "0.5", "--max-new-tokens",
            "5", "--prompt", PROMPTS[0]]
    assert cli.main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["stats"]
    # a residual window as long as the prompt holds every entry twice (codes and exact)
    assert cli.main([*argv, "--json", "--kv-bits", "8", "--kv-group", "16"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["kv"] == "8-bit, groups of 16, residual 64" and plain["kv"] == ""
    assert stats["bytes_held"] > plain["bytes_held"]
    assert cli.main([*argv, "--json", "--kv-bits", "8", "--kv-residual", "4"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["bytes_held"] < 0.7 * plain["bytes_held"]
    assert cli.main([*argv, "--kv-bits", "4", "--kv-group", "8"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["KV", "storage", "4-bit,", "groups", "of", "8,", "residual", "64"]
               for line in table)
    context = tmp_path / "ctx.txt"
    context.write_text(PROMPTS[0])
    assert cli.main(["--model", "tiny", "--policy", "snapkv", "--budget", "0.5",
                     "--context-file", str(context), "--question", "where?", "--question",
                     "who?", "--max-new-tokens", "4", "--kv-bits", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["answers"]) == 2 and out["stats"]["kv"].startswith("8-bit")
