"""The GGUF conversion's progress: one bar of its six steps on a terminal, a line a step when
piped, nothing under ``kvgate prepare --quiet`` (the conversion's work replaced by a tiny
model: what is shown, not what is converted, is tested here)."""

from __future__ import annotations

import argparse
import sys

import pytest
from conftest import build, tiny_llama_config
from progress_fakes import Terminal

from kvgate.cli.tools import add_prepare_parser, main_prepare, run_prepare
from kvgate.models import gguf as gguf_mod


class Tokenizer:
    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 100 for c in text]}

    def save_pretrained(self, folder):
        pass


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """``prepare_embedded('smollm2-135m')`` converts a tiny random model in a moment."""
    import transformers

    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_mod, "embedded_gguf_path", lambda alias: source)
    monkeypatch.setattr(gguf_mod, "_read_gguf",
                        lambda path: (build(tiny_llama_config()), Tokenizer()))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda folder: Tokenizer())
    monkeypatch.setattr(gguf_mod, "_check_tokenizer", lambda original, saved: None)
    monkeypatch.setattr(gguf_mod, "_check_model", lambda *args: 12.0)
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)  # every step, however fast
    return tmp_path / "cache" / "models" / "smollm2-135m"


def test_a_terminal_gets_one_bar_of_the_six_steps(fake_gguf, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert gguf_mod.prepare_embedded("smollm2-135m") == fake_gguf
    text = screen.getvalue()
    assert "converting smollm2-135m" in text and "\r" in text
    assert "6/6 [" in text and "model checked" in text


def test_piped_progress_is_a_line_a_step(fake_gguf, capsys):
    assert main_prepare(["--prepare", "smollm2-135m"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"smollm2-135m: {fake_gguf}"
    lines = [line for line in err.splitlines() if line.startswith("converting smollm2-135m:")]
    assert [line.split(" steps")[0] for line in lines] == [
        f"converting smollm2-135m: {i}/6" for i in range(1, 7)]
    assert lines[0].endswith("; read and dequantised") and "left" in lines[0]
    assert lines[-1].endswith("done; model checked")
    assert gguf_mod.is_converted(fake_gguf)


@pytest.mark.parametrize("spelling", ["kvgate prepare", "python -m kvgate.models"])
def test_quiet_shows_no_progress(fake_gguf, capsys, monkeypatch, spelling):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    if spelling == "kvgate prepare":
        sub = argparse.ArgumentParser().add_subparsers()
        args = add_prepare_parser(sub).parse_args(["smollm2-135m", "--quiet"])
        assert run_prepare(args) == 0
    else:
        assert main_prepare(["--prepare", "smollm2-135m", "--quiet"]) == 0
    assert "converting smollm2-135m:" not in screen.getvalue()
    assert capsys.readouterr().out.strip() == f"smollm2-135m: {fake_gguf}"
    assert gguf_mod.is_converted(fake_gguf)
