"""``eval ppl --context`` on texts too short for the windows asked (issue #64 case 13): the
refusal advised "more --docs or a smaller --windows" for ``--text-files``, where neither
applies; it now says what the files hold and what would give more."""

from __future__ import annotations

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import CharTokenizer, cli

import kvgate.eval.commands


@pytest.fixture
def tiny(monkeypatch):
    model = build(tiny_llama_config())
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, CharTokenizer(), {"model": "tiny",
                                                              "checkpoint": None}))


PPL = ["eval", "ppl", "--model", "x", "--policies", "full", "--context", "40",
       "--continuation", "20", "--no-progress"]


def test_an_empty_text_file_gets_advice_for_files(capsys, tiny, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    code, _, err = cli(capsys, *PPL, "--text-files", str(tmp_path / "empty.txt"), "--windows",
                       "1", "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --text-files: the files hold 0 tokens, too few for 1 "
                          "window(s) of --context 40 + --continuation 20 = 60; give longer or "
                          "more files or a smaller --context / --continuation")
    assert "--docs" not in err


def test_files_short_of_the_windows_asked_say_how_many_fit(capsys, tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 150)  # 151 tokens with the BOS, 152 with the EOS: two windows of 60
    code, _, err = cli(capsys, *PPL, "--text-files", str(text), "--windows", "3", "--out",
                       str(tmp_path / "o"))
    assert code == 2 and "the files hold 152 tokens" in err
    assert "give longer or more files, --windows 2 or a smaller --context" in err
    code, _, err = cli(capsys, *PPL, "--text-files", str(text), "--windows", "2", "--out",
                       str(tmp_path / "o"))
    assert code == 0, err
