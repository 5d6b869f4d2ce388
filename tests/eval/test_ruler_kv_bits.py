"""``kvgate eval ruler --kv-bits 8`` end to end on a tiny model: every key scored over quantized
caches (the shared prefill's variants and a policy run alone), the storage stored with each
result and a changed one refused on resume, bad values refused in one line before loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import cli, fake_loader, results

from kvgate.cache.quant import KVQuant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

BASE = ["eval", "ruler", "--model", "x", "--tasks", "niah_single_1,vt", "--lengths", "300",
        "--depths", "50", "--policies", "full,snapkv,roco", "--budgets", "0.5", "--limit", "2",
        "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture
def tiny(monkeypatch):
    model = build(tiny_llama_config(max_position_embeddings=640))
    return fake_loader(monkeypatch, model, char_tokenizer)


def test_ruler_at_8_bits_end_to_end(capsys, tiny, tmp_path, monkeypatch):
    from kvgate.cache.compressed import CompressedCache

    stored = []  # the storage of every cache that attended
    attend = CompressedCache.attend

    def spy(self, *args, **kwargs):
        stored.append(self.kv)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(CompressedCache, "attend", spy)
    out = tmp_path / "q8"
    code, _, err = cli(capsys, *BASE, "--kv-bits", "8", "--kv-group", "8", "--kv-residual",
                       "16", "--out", str(out))
    assert code == 0, err
    res = results(out)
    assert set(res) == {f"ruler|{t}@300|{p}|agnostic" for t in ("niah_single_1", "vt")
                        for p in ("full|none", "snapkv|0.5", "roco|0.5")}
    for rec in res.values():
        assert rec["complete"] and rec["n"] == 2
        assert rec["settings"]["kv_bits"] == 8 and rec["settings"]["kv_group"] == 8
        assert rec["settings"]["kv_residual"] == 16
        for ex in rec["examples"].values():
            assert {"output", "score", "kept"} <= set(ex)
    assert res["ruler|vt@300|snapkv|0.5|agnostic"]["evict_pct"] == pytest.approx(50, abs=5)
    # the shared prefill's own cache attends at 16 bits; every cache that answered is 8-bit
    quantized = [kv for kv in stored if kv.quantized]
    assert quantized and set(quantized) == {KVQuant(8, 8, 16)}
    # one shared prefill per example (2 tasks x 2), one attention call per layer (2)
    assert stored.count(KVQuant()) == 8

    # the same folder at another storage is refused in one line, before anything is scored
    before = (out / "results.json").read_text()
    code, _, err = cli(capsys, *BASE, "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "--kv-bits 8" in err and "--kv-bits 16" in err
    code, _, err = cli(capsys, *BASE, "--kv-bits", "8", "--kv-group", "8", "--out", str(out))
    assert code == 2 and "--kv-residual 16" in err and "--kv-residual 64" in err
    assert (out / "results.json").read_text() == before


def test_results_stored_before_the_setting_read_as_16_bits(capsys, tiny, tmp_path):
    import json

    out = tmp_path / "old"
    code, _, err = cli(capsys, *BASE, "--policies", "full", "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    for rec in data["results"].values():  # as a run before kv_bits existed stored them
        del rec["settings"]["kv_bits"]
    (out / "results.json").write_text(json.dumps(data))
    code, _, err = cli(capsys, *BASE, "--policies", "full", "--out", str(out))
    assert code == 0, err
    code, _, err = cli(capsys, *BASE, "--policies", "full", "--kv-bits", "4", "--out", str(out))
    assert code == 2 and "stored before the setting existed" in err


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "2"], "--kv-bits must be 16, 8 or 4, got 2"),
    (["--kv-bits", "4", "--kv-group", "0"], "--kv-group must be an int >= 1, got 0"),
    (["--kv-residual", "-1"], "--kv-residual must be an int >= 0, got -1"),
])
def test_bad_storage_flags_are_one_line_before_loading(capsys, tiny, tmp_path, argv, message):
    code, _, err = cli(capsys, *BASE, *argv, "--out", str(tmp_path / "x"))
    assert code == 2 and message in err and err.count("\n") == 1
    assert tiny == []
