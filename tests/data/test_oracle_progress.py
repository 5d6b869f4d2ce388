"""``kvgate data oracle``'s progress: one bar of blocks done / all blocks on a terminal, a plain
line a shard when piped (a resumed run counts from what was done), nothing when quiet; the
labels are the same either way."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from conftest import build, tiny_llama_config
from kvtrain_fixtures import SyntheticCPT, char_tokenizer
from progress_fakes import Terminal

from kvgate.data.oracle import LabelStore
from kvgate.data.oracle import compute as compute_mod
from kvgate.data.oracle.compute import label_data

LINE = re.compile(r"oracle labels: (\d+)/(\d+) blocks \(\d+%\), \w+ elapsed, "
                  r"(~\w+ left|done); blocks \d+-\d+")


def data(path) -> SyntheticCPT:
    dm = SyntheticCPT(n_docs=3, seq_len=24, batch_size=2, val_fraction=0.0,
                      oracle={"path": str(path), "chunk": 16, "shard_blocks": 3})
    dm.tokenizer = char_tokenizer()
    return dm


def run(path, **kwargs) -> tuple[SyntheticCPT, list[str]]:
    said: list[str] = []
    dm = data(path)
    label_data(build(tiny_llama_config()), char_tokenizer(), dm, "tiny", said.append, **kwargs)
    return dm, said


def test_a_terminal_gets_one_bar_of_all_blocks(tmp_path, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    dm, said = run(tmp_path / "labels")
    blocks = dm.train_blocks().shape[0]
    text = screen.getvalue()
    assert text.count("oracle labels:") >= 2 and "\r" in text
    assert f"{blocks}/{blocks} [" in text and "<" in text  # done / total [elapsed<left]
    assert said[0].startswith("oracle labels: ") and said[1].startswith("done: ")
    assert len(said) == 2  # the run's own lines (stdout) hold no per-shard progress


def test_piped_progress_is_a_line_a_shard_and_a_resumed_run_counts_from_what_was_done(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kvgate.progress.LINE_EVERY_S", 0.0)  # every shard, however fast
    dm, _ = run(tmp_path / "labels")
    blocks = dm.train_blocks().shape[0]
    shards = -(-blocks // 3)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == shards and all(LINE.fullmatch(line) for line in lines)
    assert [int(LINE.match(line)[1]) for line in lines] == [min(3 * (i + 1), blocks)
                                                            for i in range(shards)]
    assert lines[-1].startswith(f"oracle labels: {blocks}/{blocks} blocks (100%)")
    # a run killed after its first shard, then resumed: the count starts at 3
    broken = tmp_path / "broken"
    real, calls = compute_mod.shard_labels, []

    def dying(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(compute_mod, "shard_labels", dying)
        with pytest.raises(KeyboardInterrupt):
            run(broken)
    capsys.readouterr()
    run(broken)
    again = capsys.readouterr().err.strip().splitlines()
    assert again[0].startswith(f"oracle labels: 6/{blocks} blocks")
    assert len(again) == shards - 1
    assert torch.equal(LabelStore(broken).read(), LabelStore(dm.oracle.path).read())


def test_quiet_draws_nothing_and_labels_the_same(tmp_path, monkeypatch, capsys):
    loud, _ = run(tmp_path / "loud")
    capsys.readouterr()
    for stream in (Terminal(), None):
        if stream is not None:
            monkeypatch.setattr(sys, "stderr", stream)
        quiet, _ = run(tmp_path / f"quiet{stream is None}", quiet=True)
        assert (stream.getvalue() if stream is not None else capsys.readouterr().err) == ""
        assert torch.equal(LabelStore(quiet.oracle.path).read(),
                           LabelStore(loud.oracle.path).read())
        monkeypatch.undo()
