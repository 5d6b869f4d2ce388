"""An output folder that cannot be written (issue #64 case 11): every command with one refuses
it in one line naming the flag and the path before any work, root included (tests run as
root, whom permission bits do not stop: the folder is made immutable, ``chattr +i``)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

import pytest
import yaml
from kvtrain_fixtures import tiny_config

import kvgate.cli.train  # Lightning's log handler takes the real stderr on import, not capsys's
import kvgate.eval.commands
import kvgate.models
import kvgate.training
from kvgate.cli import main
from kvgate.files import UserFileError, check_output_dir


def _chattr(flag: str, path) -> bool:
    chattr = shutil.which("chattr")
    return chattr is not None and subprocess.run(
        [chattr, flag, str(path)], check=False, capture_output=True).returncode == 0


@pytest.fixture
def locked(tmp_path):
    """A folder in which nothing can be created, whoever asks."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if _chattr("+i", folder):
        try:
            (folder / "x").write_text("x")
        except OSError:
            yield folder
            _chattr("-i", folder)
            return
        _chattr("-i", folder)  # the attribute took but does not bind on this file system
        (folder / "x").unlink()
    if os.geteuid() == 0:
        pytest.skip("no immutable folders here (chattr +i), and root passes permission bits")
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_a_folder_that_cannot_be_written_is_refused_in_one_line(locked):
    with pytest.raises(UserFileError, match=f"^--out {locked}: nothing can be written in it "):
        check_output_dir(locked, "--out")
    below = locked / "new" / "out"
    with pytest.raises(UserFileError, match=f"^--out {below}: nothing can be written in "
                                            f"{locked} "):
        check_output_dir(below, "--out")
    assert list(locked.iterdir()) == []


def test_the_probe_is_what_decides_and_leaves_nothing(tmp_path, monkeypatch):
    """Permission bits are not asked (root passes them): a folder where creating a file fails
    is refused, and a writable one is left as it was."""
    assert check_output_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(UserFileError, match="nothing can be written in it \\(Read-only file "):
        check_output_dir(tmp_path, "--run_dir")


@pytest.fixture
def refuse_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing may load when the output folder cannot be written")

    monkeypatch.setattr(kvgate.eval.commands, "load_model", refuse)
    monkeypatch.setattr(kvgate.training.KVGateModule, "configure_model", refuse)
    monkeypatch.setattr(kvgate.models, "load_base", refuse)


def _train_config(tmp_path, oracle=None):
    config = tiny_config(tmp_path, str(tmp_path / "no-base"))
    if oracle is not None:
        cfg = yaml.safe_load(config.read_text())
        cfg["data"]["init_args"]["oracle"] = {"path": str(oracle), "chunk": 16}
        config.write_text(yaml.safe_dump(cfg))
    return str(config)


@pytest.mark.parametrize("command", ["eval mc", "eval calibrate", "eval report", "train",
                                     "data oracle", "export"])
def test_every_command_refuses_an_unwritable_output_before_working(command, locked, tmp_path,
                                                                   capsys, refuse_loading):
    """``eval calibrate`` computed every threshold and lost them at the final write; the
    others ended in a 21-51 line PermissionError."""
    out = locked / "out"
    flag, argv = {
        "eval mc": ("--out", ["--model", "x", "--tasks", "copa", "--out", str(out)]),
        "eval calibrate": ("--out", ["--checkpoint", "c", "--out", str(out)]),
        "eval report": ("--out", ["--out", str(out)]),
        "train": ("--run_dir", ["--config", _train_config(tmp_path), "--run_dir", str(out)]),
        "data oracle": ("data.init_args.oracle.path",
                        ["--config", _train_config(tmp_path, oracle=out)]),
        "export": ("OUT", [str(tmp_path / "run.ckpt"), str(out)]),
    }[command]
    code = main([*command.split(), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {flag} {out}: nothing can be written in {locked} ")
    assert list(locked.iterdir()) == []
