"""Prompts longer than the model's context in every eval path (issue 36, case 2: a 21,560-token
prompt on an 8,192-token model ran for minutes and printed garbage): refused in one line naming
the example and both lengths before anything is scored, or cut with --truncate, which says what
it dropped. Needle prompts and ppl windows are never cut: their length is the setting."""

from __future__ import annotations

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import CharTokenizer, cli, results

import kvgate.eval.commands
from kvgate.eval.masked import ScoringItem
from kvgate.eval.multiple_choice import fit_items
from kvgate.models.limits import InputTooLongError

LIMIT = 64  # copa:0 (39 context + 30 choice tokens), copa:1 (45 + 29), copa:3 (38 + 45) overrun
TEXT = "The quick brown fox jumps over the lazy dog while the birds sing in the trees. " * 4


@pytest.fixture
def short(monkeypatch):
    """``kvgate eval`` on a tiny model of ``LIMIT`` positions (``short.limit`` to change it)."""
    class Short:
        limit = LIMIT

    def load(cfg):
        return (build(tiny_llama_config(max_position_embeddings=Short.limit)), CharTokenizer(),
                {"model": "tiny", "checkpoint": None})

    monkeypatch.setattr(kvgate.eval.commands, "load_model", load)
    return Short




@pytest.mark.parametrize("command", ["mc", "matched"])
@pytest.mark.parametrize("mode", ["masked", "cache"])
def test_a_task_example_longer_than_the_model_is_refused_in_one_line(capsys, short, tmp_path,
                                                                     command, mode):
    extra = ["--reference", "snapkv"] if command == "matched" else []
    code, out, err = cli(capsys, "eval", command, "--model", "x", "--out", str(tmp_path),
                         "--tasks", "copa", "--policies", "full", "--limit", "4", "--mode", mode,
                         "--no-progress", *extra)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: copa:") and "context + " in err
    assert f"at most {LIMIT}" in err and "--truncate" in err
    assert not (tmp_path / "results.json").exists()  # refused before anything was scored


@pytest.mark.parametrize("mode", ["masked", "cache"])
def test_truncate_cuts_task_contexts_from_the_start_and_says_so(capsys, short, tmp_path, mode):
    code, _, err = cli(capsys, "eval", "mc", "--model", "x", "--out", str(tmp_path), "--tasks",
                       "copa", "--policies", "full", "--limit", "4", "--mode", mode,
                       "--truncate", "--no-progress")
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("warning: --truncate")]
    assert len(warning) == 1 and "cut 3 of 4 copa contexts" in warning[0]
    assert "34 tokens in all: copa:0 (-5), copa:1 (-10), copa:3 (-19)" in warning[0]
    record = results(tmp_path)["mc|copa|full|none|masked".replace("masked", mode)]
    assert record["n"] == 4 and record["settings"]["truncate"] is True
    assert record["examples"]["copa:3"]["n_ctx"] == LIMIT - 45


def test_fit_items_leaves_what_fits_and_refuses_a_choice_that_cannot():
    items = [ScoringItem("a", (1,) * 10, ((2,) * 3, (3,))), ScoringItem("b", (1,) * 30, ((2,),))]
    assert fit_items(items, None) == items and fit_items(items, 31)[1] is items[1]
    with pytest.raises(InputTooLongError, match=r"b has 30 context \+ 1 choice tokens = 31"):
        fit_items(items, 20)
    assert fit_items(items, 20, truncate=True)[1].context == (1,) * 19
    with pytest.raises(InputTooLongError, match="a choice of 3 tokens leaves no room"):
        fit_items(items, 3, truncate=True)


@pytest.mark.parametrize("scoring, room", [("rank", 6), ("generate", 8)])
def test_a_needle_longer_than_the_model_is_refused(capsys, short, tmp_path, scoring, room):
    text = tmp_path / "filler.txt"
    text.write_text(TEXT)
    short.limit = 200
    argv = ["eval", "needle", "--model", "x", "--policies", "full", "--depths", "50",
            "--samples", "1", "--scoring", scoring, "--text-files", str(text), "--no-progress"]
    code, _, err = cli(capsys, *argv, "--out", str(tmp_path / "a"), "--lengths",
                       f"{200 - room},{200 - room + 1}")
    assert code == 2 and err.count("\n") == 1
    assert f"needle prompt needle:{201 - room}:50:0 has {201 - room} tokens + {room}" in err
    assert "at most 200" in err and f"--lengths of at most {200 - room}" in err
    assert not (tmp_path / "a" / "results.json").exists()  # the fitting length waited too
    code, _, err = cli(capsys, *argv, "--out", str(tmp_path / "b"), "--lengths",
                       str(200 - room))
    assert code == 0, err


def test_a_text_longer_than_the_model_is_refused_or_cut(capsys, short, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)  # 316 tokens with BOS, under the default --max-length 512
    short.limit = 256
    argv = ["eval", "ppl", "--model", "x", "--policies", "full", "--text-files", str(text),
            "--no-progress"]
    code, _, err = cli(capsys, *argv, "--out", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1
    assert "text corpus:0 has 316 tokens (at --max-length 512)" in err and "at most 256" in err
    code, _, err = cli(capsys, *argv, "--out", str(tmp_path / "b"), "--truncate")
    assert code == 0, err
    assert "warning: --truncate cut 1 of 1 texts to the model's 256 positions, dropping 60 " in err
    example = results(tmp_path / "b")["ppl|corpus|full|none|masked"]["examples"]["corpus:0"]
    assert example["n_ctx"] + example["tokens"][0] == 256


def test_a_ppl_window_longer_than_the_model_is_refused_even_with_truncate(capsys, short,
                                                                          tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT * 3)
    code, _, err = cli(capsys, "eval", "ppl", "--model", "x", "--policies", "full",
                       "--text-files", str(text), "--context", "48", "--continuation", "17",
                       "--truncate", "--out", str(tmp_path), "--no-progress")
    assert code == 2 and err.count("\n") == 1
    assert "--context 48 + --continuation 17 = 65 tokens" in err and f"at most {LIMIT}" in err
