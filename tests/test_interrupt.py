"""Ctrl-C in any ``kvgate`` command (issue #64 case 3): one line naming the command and what
was kept, exit 130, and what was finished left where a rerun finds it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, build, tiny_llama_config
from test_cli import CharTokenizer

import kvgate.cli.oracle
import kvgate.cli.train  # Lightning's log handler takes the real stderr on import, not capsys's
import kvgate.eval.commands
import kvgate.models
import kvgate.training.export
from kvgate.cli import main


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command, argv, patch, kept", [
    ("infer", ["--model", "x", "--prompt", "hi"], (kvgate.models, "load_base"),
     "nothing was written"),
    ("eval ruler", ["--model", "x", "--tasks", "niah_single_1", "--lengths", "64"],
     (kvgate.eval.commands, "load_model"), "finished results are kept in"),
    ("data oracle", ["--config", "cpt_oracle"], (kvgate.cli.oracle, "run"),
     "finished label shards are kept"),
    ("export", ["run.ckpt", "OUT"], (kvgate.training.export, "export_checkpoint"), "rerun"),
])
def test_ctrl_c_in_a_command_is_one_line_and_exit_130(capsys, monkeypatch, tmp_path, command,
                                                      argv, patch, kept):
    """Issue #64 case 3: a 94-131 line KeyboardInterrupt traceback, exit 1."""
    monkeypatch.setattr(*patch, interrupt)
    if command.startswith("eval"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    code = main([*command.split(), *argv])
    err = capsys.readouterr().err
    assert code == 130
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"interrupted: kvgate {command}; ")
    assert kept in err


def test_debug_shows_the_interrupts_traceback(monkeypatch):
    monkeypatch.setattr(kvgate.models, "load_base", interrupt)
    with pytest.raises(KeyboardInterrupt):
        main(["infer", "--model", "x", "--prompt", "hi", "--debug"])


def test_an_interrupted_eval_keeps_every_example_it_finished(capsys, monkeypatch, tmp_path):
    """The store writes a key's examples at most every 30 s: the ones scored since its last
    write are written when Ctrl-C arrives, and the rerun scores only the rest."""
    model = build(tiny_llama_config())
    calls = {"n": 0}

    def third_forward_interrupts(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    hook = model.register_forward_pre_hook(third_forward_interrupts, with_kwargs=True)
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, CharTokenizer(), {"model": "tiny", "checkpoint": None}))
    argv = ["eval", "mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa",
            "--policies", "full", "--limit", "4", "--batch-size", "1", "--no-progress"]
    assert main(argv) == 130
    assert capsys.readouterr().err.startswith("interrupted: kvgate eval mc; finished results")
    stored = json.loads((tmp_path / "results.json").read_text())["results"]
    (key, result), = stored.items()
    assert not result["complete"] and len(result["examples"]) == 2
    hook.remove()
    calls["n"] = 0
    counting = model.register_forward_pre_hook(lambda m, a, k: calls.__setitem__(
        "n", calls["n"] + 1), with_kwargs=True)
    assert main(argv) == 0
    counting.remove()
    assert calls["n"] == 2  # only the two examples the interrupted run had not finished
    assert json.loads((tmp_path / "results.json").read_text())["results"][key]["complete"]


CHILD = """
import sys, time
import kvgate.eval.commands as commands
from kvgate.cli import main

def slow_load(cfg):
    print("loading", flush=True)
    time.sleep(120)

commands.load_model = slow_load
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child needs POSIX signals")
def test_sigint_to_a_running_kvgate_process_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "eval", "ruler", "--model", "x", "--tasks",
         "niah_single_1", "--lengths", "64", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    try:
        assert child.stdout.readline().strip() == "loading"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: kvgate eval ruler;"), err
    assert not out.exists()  # nothing was scored: nothing made
