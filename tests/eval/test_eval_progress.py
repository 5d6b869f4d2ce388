"""``kvgate eval``'s progress: one display for the whole run, over every (result key, example)
pair it plans (a bar on a terminal, a line a step when piped, nothing under ``--quiet`` or
``--no-progress``), counting a shared prefill's records once and a resumed run's stored ones
not at all; calibration counts its compressions. The scores are the same either way."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import build, patch_evicting, tiny_llama_config
from eval_fakes import CharTokenizer, cli, results
from progress_fakes import Terminal

import kvgate.eval.commands
from kvgate.eval.benchmarks.ruler.run import evaluate_ruler
from kvgate.eval.store import ResultStore
from kvgate.policies import Budget, get_policy

LINE = re.compile(r"(?P<what>[\w ]+): (?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+) \(\d+%\), "
                  r"\w+ elapsed, (~\w+ left|done); (?P<note>.+)")
MC = ["eval", "mc", "--model", "x", "--tasks", "copa", "--policies", "full,window",
      "--budgets", "0.5,0.25", "--batch-size", "1"]  # three keys: full, window at each budget


@pytest.fixture
def tiny_cli(monkeypatch, tiny_llama):
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (tiny_llama, CharTokenizer(),
                                     {"model": "tiny", "checkpoint": None}))
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)  # a line every step
    return tiny_llama


def shown(err: str, what: str) -> list[re.Match]:
    lines = [LINE.fullmatch(line) for line in err.splitlines() if line.startswith(what + ":")]
    assert all(lines), err
    return lines


def test_a_terminal_gets_one_bar_for_the_whole_run(tiny_cli, tmp_path, monkeypatch, capsys):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    code, out, _ = cli(capsys, *MC, "--limit", "3", "--out", str(tmp_path))
    assert code == 0 and "| copa | window | 0.5 |" in out  # the results table
    bar = screen.getvalue()
    assert "mc: " in bar and "\r" in bar and "9/9 [" in bar and "<" in bar
    assert bar.count("\n") == 1 and bar.endswith("\n")  # one bar, left on screen at the end


def test_piped_lines_count_every_pair_and_a_resumed_run_only_what_is_left(tiny_cli, tmp_path,
                                                                         capsys):
    code, _, err = cli(capsys, *MC, "--limit", "3", "--out", str(tmp_path))
    assert code == 0
    lines = shown(err, "mc")
    assert [(int(m["done"]), int(m["total"])) for m in lines] == [(i, 9) for i in range(1, 10)]
    assert lines[0]["unit"] == "examples" and "left" in lines[0][0]
    assert lines[-1][0].endswith("done; mc|copa|window|0.25|masked")
    # one more example a key: the 9 stored leave the plan as each key's turn comes
    code, _, err = cli(capsys, *MC, "--limit", "4", "--out", str(tmp_path))
    assert code == 0
    assert [(int(m["done"]), int(m["total"])) for m in shown(err, "mc")] == \
        [(1, 9), (2, 6), (3, 3)]
    code, _, err = cli(capsys, *MC, "--limit", "4", "--out", str(tmp_path))
    assert code == 0 and shown(err, "mc") == []  # nothing left to score: no line


@pytest.mark.parametrize("flag", ["--quiet", "--no-progress"])
def test_quiet_shows_nothing_and_scores_the_same(tiny_cli, tmp_path, monkeypatch, capsys, flag):
    code, _, _ = cli(capsys, *MC, "--limit", "3", "--out", str(tmp_path / "loud"))
    assert code == 0
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    code, out, _ = cli(capsys, *MC, "--limit", "3", "--out", str(tmp_path / "quiet"), flag)
    assert code == 0 and "| copa | window | 0.5 |" in out
    assert screen.getvalue() == ""
    loud, quiet = results(tmp_path / "loud"), results(tmp_path / "quiet")
    assert sorted(loud) == sorted(quiet)
    for key in loud:
        assert {u: r["ll"] for u, r in loud[key]["examples"].items()} == \
            {u: r["ll"] for u, r in quiet[key]["examples"].items()}


def test_a_shared_prefill_counts_each_record_once(tmp_path, monkeypatch, capsys):
    """RULER's one-shot policies share each example's prefill: the first key scores the
    example for all of them; the display counts every record when it is made, never twice."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
    from engine_toys import char_tokenizer

    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)
    model = build(tiny_llama_config(max_position_embeddings=640))
    store = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=1e9)
    policies = {name: get_policy(name) for name in ("full", "snapkv", "knorm")}
    keys = evaluate_ruler(model, char_tokenizer(), ["niah_single_1", "vt"], [300], policies,
                          [Budget(ratio=0.5), Budget(ratio=0.25)], store, depths=(50,),
                          limit=2, max_new_tokens=4)
    assert len(keys) == 2 * 5  # per task: full once, snapkv and knorm at two budgets
    lines = shown(capsys.readouterr().err, "ruler")
    total = 2 * 2 * 5  # examples x keys
    assert all(int(m["total"]) == total for m in lines)
    assert [int(m["done"]) for m in lines] == list(range(1, total + 1))  # each record once
    # the first key scores an example for all five: the last record is its own
    assert lines[-1][0].endswith("done; ruler|vt@300|full|none|agnostic")


@pytest.fixture
def gated_cli(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
    from engine_toys import char_tokenizer

    model = build(tiny_llama_config(max_position_embeddings=640))
    patch_evicting(model)
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, char_tokenizer(), {"model": "tiny",
                                                               "checkpoint": "c"}))
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)


CALIBRATE = ["eval", "calibrate", "--checkpoint", "c", "--policies", "local_gate",
             "--policy-opt", "local_gate.window=4", "--lengths", "300", "--tasks",
             "niah_single_1", "--limit", "2", "--evict", "0.3,0.6", "--tol", "0.05",
             "--max-runs", "6"]


def test_calibration_counts_compressions_and_drops_the_runs_a_search_did_not_need(
        gated_cli, tmp_path, monkeypatch, capsys):
    code, _, err = cli(capsys, *CALIBRATE, "--out", str(tmp_path / "piped"))
    assert code == 0, err
    lines = shown(err, "calibrate")
    plan = 2 * 6 * 2  # targets x max runs x contexts
    assert int(lines[0]["total"]) == plan and lines[0]["unit"] == "compressions"
    assert lines[0]["note"].startswith("local_gate at tau ")
    saved = json.loads((tmp_path / "piped" / "calibration.json").read_text())
    runs = sum(f["runs"] for f in saved["fits"])
    assert int(lines[-1]["done"]) == int(lines[-1]["total"]) == 2 * runs < plan
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    code, _, _ = cli(capsys, *CALIBRATE, "--out", str(tmp_path / "bar"))
    assert code == 0 and f"{2 * runs}/{2 * runs} [" in screen.getvalue()
    screen.truncate(0)
    code, _, _ = cli(capsys, *CALIBRATE, "--out", str(tmp_path / "quiet"), "--quiet")
    assert code == 0 and screen.getvalue() == ""
    assert (tmp_path / "quiet" / "calibration.md").read_text() == \
        (tmp_path / "bar" / "calibration.md").read_text()
