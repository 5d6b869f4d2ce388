"""``kvgate train``'s progress: one display of optimiser steps done of the run's (a bar on a
terminal, a line a step when piped, the logged loss beside it) in place of Lightning's bar; a
resumed run counts from its step; ``--quiet`` and a config without a bar show none; the
trained weights are the same either way."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from kvtrain_fixtures import save_tiny_base, tiny_config
from progress_fakes import Terminal

from kvgate.cli.train import main

LINE = re.compile(r"training: (\d+)/(\d+) steps \(\d+%\), \w+ elapsed, (~\w+ left|done); "
                  r"train/lm_loss [\d.]+.*")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def config(folder, base_dir, bar=True):
    folder.mkdir(parents=True, exist_ok=True)
    return str(tiny_config(folder, base_dir, enable_progress_bar=bar))


def steps(err: str) -> list[tuple[int, int]]:
    lines = [line for line in err.splitlines() if line.startswith("training:")]
    assert all(LINE.fullmatch(line) for line in lines), lines
    return [(int(LINE.match(line)[1]), int(LINE.match(line)[2])) for line in lines]


def test_a_terminal_gets_one_bar_of_optimiser_steps(base_dir, tmp_path, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["--config", config(tmp_path, base_dir)]) == 0
    text = screen.getvalue()
    assert "training:" in text and "3/3 [" in text and "train/lm_loss" in text
    assert "Epoch 0" not in text  # not Lightning's bar


def test_piped_lines_a_step_and_a_resumed_run_counts_from_its_step(base_dir, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)
    cfg = config(tmp_path, base_dir)
    assert main(["--config", cfg]) == 0
    err = capsys.readouterr().err
    assert steps(err) == [(1, 3), (2, 3), (3, 3)] and "\rtraining" not in err
    assert main(["--config", cfg, "--ckpt_path", "last", "--trainer.max_steps", "5"]) == 0
    assert steps(capsys.readouterr().err) == [(4, 5), (5, 5)]


def test_quiet_and_a_config_without_a_bar_show_none_and_train_the_same(base_dir, tmp_path,
                                                                      monkeypatch, capsys):
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)
    assert main(["--config", config(tmp_path / "loud", base_dir)]) == 0
    assert steps(capsys.readouterr().err)
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["--config", config(tmp_path / "quiet", base_dir), "--quiet"]) == 0
    assert main(["--config", config(tmp_path / "off", base_dir, bar=False)]) == 0
    assert "training" not in screen.getvalue() and "Epoch" not in screen.getvalue()
    weights = [torch.load(tmp_path / run / "run" / "ckpt" / "last.ckpt", weights_only=False)
               ["state_dict"] for run in ("loud", "quiet", "off")]
    for other in weights[1:]:
        assert weights[0].keys() == other.keys()
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])
