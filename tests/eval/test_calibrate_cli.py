"""``kvgate eval calibrate`` end to end on a tiny gated LLaMA: the table and files it writes,
the thresholds it prints reproduce their shares, and bad settings are one line before loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import build, patch_evicting, tiny_llama_config
from eval_fakes import cli

import kvgate
import kvgate.eval.commands
from kvgate.eval.benchmarks.ruler.tasks import generate
from kvgate.inference.calibrate import evicted_share
from kvgate.policies import get_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

BASE = ["eval", "calibrate", "--checkpoint", "c", "--policies", "local_gate,lg2=local_gate",
        "--policy-opt", "local_gate.window=4", "--policy-opt", "lg2.window=32",
        "--lengths", "300,360", "--tasks", "niah_single_1,niah_single_2", "--limit", "1",
        "--evict", "0.3,0.6", "--tol", "0.05", "--max-runs", "12", "--no-progress"]


@pytest.fixture(scope="module")
def gated():
    model = build(tiny_llama_config(max_position_embeddings=640))
    patch_evicting(model)
    return model


@pytest.fixture
def tiny(monkeypatch, gated):
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (gated, char_tokenizer(), {"model": "tiny",
                                                               "checkpoint": "c"}))
    return gated


def test_calibrate_writes_each_threshold_and_its_share(capsys, tiny, tmp_path):
    code, out, err = cli(capsys, *BASE, "--out", str(tmp_path / "c"))
    assert code == 0, err
    saved = json.loads((tmp_path / "c" / "calibration.json").read_text())
    assert saved["meta"]["model"] == "tiny" and saved["settings"]["seed"] == 1000
    fits = saved["fits"]
    assert [(f["policy"], f["length"], f["target"]) for f in fits] == [
        (p, n, t) for n in (300, 360) for p in ("local_gate", "lg2") for t in (0.3, 0.6)]
    tok = char_tokenizer()
    for f in fits:
        assert f["contexts"] == 2
        # the held-out haystacks (seed 1000 on) of both tasks, compressed again at that tau
        texts = [generate(t, tok, f["length"], seed=1000).context
                 for t in ("niah_single_1", "niah_single_2")]
        window = 4 if f["policy"] == "local_gate" else 32
        policy = get_policy("local_gate", window=window, tau=f["tau"])
        assert evicted_share(tiny, tok, policy, texts) == pytest.approx(f["evicted"])
        assert f["reached"] == (abs(f["evicted"] - f["target"]) <= 0.05)
        assert f"--policy-opt {f['policy']}.tau={f['tau']:.4f}" in out
    # a wider recent window keeps more, so it needs a higher threshold for the same share
    by = {(f["policy"], f["length"], f["target"]): f["tau"] for f in fits}
    assert by[("lg2", 360, 0.3)] > by[("local_gate", 360, 0.3)]
    assert (tmp_path / "c" / "calibration.md").read_text().startswith("| policy | length |")


@pytest.mark.parametrize("args,message", [
    (["--evict", "0.5,1.2"], "--evict: each target must lie in (0, 1)"),
    (["--policies", "snapkv"], "--policies snapkv: policy snapkv has no threshold"),
    (["--policies", "all"], "name the gate policies"),
    (["--tasks", "nope"], "unknown RULER task 'nope'"),
    (["--tol", "0"], "--tol must lie in (0, 1)"),
])
def test_bad_settings_are_one_line_before_loading(capsys, monkeypatch, tmp_path, args, message):
    def refuse(cfg):
        raise AssertionError("the model must not load when the arguments are wrong")

    monkeypatch.setattr(kvgate.eval.commands, "load_model", refuse)
    code, _, err = cli(capsys, "eval", "calibrate", "--checkpoint", "c", "--out",
                       str(tmp_path / "x"), *args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert message in err


def test_a_base_model_has_no_gate_to_calibrate(capsys, monkeypatch, tmp_path):
    model = build(tiny_llama_config(max_position_embeddings=640))
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, char_tokenizer(), {"model": "tiny"}))
    code, _, err = cli(capsys, "eval", "calibrate", "--model", "x", "--lengths", "300",
                       "--out", str(tmp_path / "b"))
    assert code == 2 and "needs a gated model" in err
    assert not (tmp_path / "b" / "calibration.json").exists()


def test_text_files_give_each_texts_first_tokens_and_a_length_none_has_is_one_line(
        capsys, tiny, tmp_path):
    texts = tmp_path / "texts.jsonl"
    long_text = "the cat sat on the mat and looked at the door for a while. " * 8
    texts.write_text(json.dumps({"text": long_text}) + "\n" + json.dumps({"text": "short"}) + "\n")
    argv = ["eval", "calibrate", "--checkpoint", "c", "--policies", "local_gate",
            "--policy-opt", "local_gate.window=4", "--evict", "0.5", "--tol", "0.05",
            "--text-files", str(texts), "--no-progress"]
    code, _, err = cli(capsys, *argv, "--lengths", "300", "--out", str(tmp_path / "t"))
    assert code == 0, err
    (fit,) = json.loads((tmp_path / "t" / "calibration.json").read_text())["fits"]
    assert fit["contexts"] == 1  # the short text has no 300 tokens
    tok = char_tokenizer()
    policy = get_policy("local_gate", window=4, tau=fit["tau"])
    assert evicted_share(tiny, tok, policy, [long_text[:300]]) == pytest.approx(fit["evicted"])
    code, _, err = cli(capsys, *argv, "--lengths", "600", "--out", str(tmp_path / "u"))
    assert code == 2 and "no text has 600 tokens" in err and err.count("\n") == 1
    assert not (tmp_path / "u" / "calibration.json").exists()


def test_text_files_are_tokenised_each_once_and_only_as_far_as_a_length_needs():
    from types import SimpleNamespace

    from kvgate.eval.calibrate import TokenRows, contexts

    calls = []
    base = char_tokenizer()

    def tokenizer(text, add_special_tokens=False):
        calls.append(text)
        return base(text, add_special_tokens=add_special_tokens)

    tokenizer.decode = base.decode
    texts = ["a" * 50, "b" * 10, "c" * 50, "d" * 50, "e" * 50]
    rows, cfg = TokenRows(tokenizer, texts), SimpleNamespace(limit=2)
    assert contexts(cfg, tokenizer, 20, rows) == ["a" * 20, "c" * 20]
    assert calls == texts[:3]  # the first two long enough texts; d and e never tokenised
    assert contexts(cfg, tokenizer, 5, rows) == ["a" * 5, "b" * 5]
    assert calls == texts[:3]  # a second length reads what the first tokenised
