"""kvgate train refuses what would waste or spoil a run, in one line and before the model loads:
a config file that is missing or no YAML, an unknown key (issue #36, case 9), a run that would
train no step (case 3), a second run in a run folder that is in use (case 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import yaml
from kvtrain_fixtures import SyntheticCPT, save_tiny_base, tiny_config

from kvgate.cli.train import main
from kvgate.training.callbacks import ExportGated
from kvgate.training.errors import RunInUseError
from kvgate.training.module import KVGateModule
from kvgate.training.runlock import LOCK_NAME, RunLock

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(self):
        raise AssertionError("a model was loaded although the run is refused")

    monkeypatch.setattr(KVGateModule, "configure_model", refuse)


def one_error_line(capsys) -> str:
    """The whole of stderr, which must be a single ``error: ...`` line."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[:5]
    return lines[0]


# --------------------------------------------------------------------- case 9: CLI input
def _bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {"badkey": {"model": {"gate": {"betaa": 0.2}}},
             "baddata": {"data": {"init_args": {"seq_lenn": 3}}}}
    out = {name: tmp_path / f"{name}.yaml" for name in files}
    for name, cfg in files.items():
        out[name].write_text(yaml.safe_dump(cfg))
    out["badyaml"] = tmp_path / "badyaml.yaml"
    out["badyaml"].write_text("model:\n  gate: [beta\n")
    out["folder"] = tmp_path
    return out


@pytest.mark.parametrize("argv, named", [
    (["--config", "no_such_config"], "--config no_such_config: no such file"),
    (["--config=no_such.yaml"], "no_such.yaml: no such file"),
    (["--config", "cpt_demo", "--config", "{badyaml}"], "badyaml.yaml: not valid YAML"),
    (["--config", "{folder}"], "is a folder"),
    (["--config", "cpt_demo", "--model.gate.betaa", "0.2"], "--model.gate.betaa"),
    (["--config", "cpt_demo", "--config", "{badkey}"], "gate.betaa"),
    (["--config", "cpt_demo", "--config", "{baddata}"], "seq_lenn"),
    (["--config", "cpt_demo", "--data.seq_lenn", "3"], "seq_lenn"),
    (["--config", "cpt_demo", "--model.train", "everything"], "model.train"),
    (["--config", "cpt_demo", "--trainer.max_stepz", "3"], "trainer.max_stepz"),
], ids=["missing", "missing_eq", "bad_yaml", "folder", "unknown_flag", "unknown_key_in_file",
        "unknown_data_key_in_file", "unknown_data_flag", "bad_choice", "unknown_trainer_key"])
def test_config_errors_are_one_line_naming_the_file_or_key(argv, named, tmp_path, capsys,
                                                           no_model_load):
    files = _bad_files(tmp_path)
    argv = [a.format(**files) if a.startswith("{") else a for a in argv]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert named in line, line


def test_help_and_print_config_still_exit_0(capsys):
    for extra in (["--help"], ["--print_config"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", "cpt_demo", *extra])
        assert exit_info.value.code == 0
    assert "max_steps" in capsys.readouterr().out


def test_an_inline_yaml_config_is_left_to_the_parser(capsys, no_model_load):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "cpt_demo", "--config", "{trainer: {max_steps: 7}}", "--print_config"])
    assert exit_info.value.code == 0 and "max_steps: 7" in capsys.readouterr().out


# ----------------------------------------------------------------- case 3: no step to train
@pytest.mark.parametrize("override, key", [
    (["--trainer.max_steps", "0"], "trainer.max_steps"),
    (["--trainer.max_epochs", "0"], "trainer.max_epochs"),
    (["--trainer.limit_train_batches", "0"], "trainer.limit_train_batches"),
])
def test_a_run_of_no_step_is_refused_before_the_model_loads(override, key, base_dir, tmp_path,
                                                           capsys, no_model_load):
    config = tiny_config(tmp_path, base_dir)
    assert main(["--config", str(config), *override]) == 2
    assert key in one_error_line(capsys)
    assert not (tmp_path / "run").exists()  # no untrained export, no folder


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a CPU-only torch")
def test_a_gpu_accelerator_on_a_cpu_only_torch_is_one_line(base_dir, tmp_path, capsys,
                                                           no_model_load):
    config = tiny_config(tmp_path, base_dir)
    assert main(["--config", str(config), "--trainer.accelerator", "gpu"]) == 2
    assert "trainer.accelerator" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_bad_trainer_value_is_one_line_without_the_hardware_hint(base_dir, tmp_path, capsys,
                                                                    no_model_load):
    config = tiny_config(tmp_path, base_dir)
    assert main(["--config", str(config), "--trainer.max_steps", "-3"]) == 2
    line = one_error_line(capsys)
    assert "max_steps" in line and "-3" in line
    assert "--trainer.accelerator" not in line  # the machine is not the problem here


def test_export_gated_writes_nothing_after_a_run_of_no_step(base_dir, tmp_path, capsys):
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0)
    trainer = L.Trainer(max_steps=3, limit_train_batches=0, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[ExportGated(dirpath=str(tmp_path / "gated"))])
    trainer.fit(module, SyntheticCPT(seq_len=16, batch_size=2, val_fraction=0.0))
    assert trainer.global_step == 0
    assert not (tmp_path / "gated").exists()
    assert "did no training step" in capsys.readouterr().err


# ------------------------------------------------------------ case 7: one run per folder
def _hold_lock_in_child(folder: Path, then: str) -> subprocess.Popen:
    """A python child that takes the lock of ``folder``, says 'held', then runs ``then``.
    It imports runlock without the training package's heavy __init__ (torch, Lightning)."""
    code = ("import os, sys, time, types\n"
            "pkg = types.ModuleType('kvgate.training')\n"
            f"pkg.__path__ = [{str(ROOT / 'kvgate' / 'training')!r}]\n"
            "sys.modules['kvgate.training'] = pkg\n"
            "from kvgate.training.runlock import RunLock\n"
            f"lock = RunLock({str(folder)!r}).acquire()\n"
            "print('held', flush=True)\n" + then)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_run_in_a_folder_in_use_is_refused(base_dir, tmp_path, capsys, no_model_load):
    config = tiny_config(tmp_path, base_dir)
    run_dir = tmp_path / "busy"
    child = _hold_lock_in_child(run_dir, "time.sleep(120)\n")
    try:
        assert main(["--config", str(config), "--run_dir", str(run_dir)]) == 2
        line = one_error_line(capsys)
        assert f"pid {child.pid}" in line and str(run_dir) in line and "in use" in line
        # the config's own folder (no --run_dir) is a run folder too
        held = RunLock(tmp_path / "run").acquire()
        assert main(["--config", str(config)]) == 2
        assert "in use" in one_error_line(capsys)
        held.release()
    finally:
        child.kill()
        child.wait()
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # the child's, left by kill
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_lock_left_by_kill_9_is_taken_over_with_a_warning(tmp_path, capsys):
    child = _hold_lock_in_child(tmp_path, "os.kill(os.getpid(), 9)\n")
    child.wait()
    info = json.loads((tmp_path / LOCK_NAME).read_text())
    assert info["pid"] == child.pid and info["host"] and info["started"]
    with RunLock(tmp_path):
        err = capsys.readouterr().err
        assert err.startswith("warning: ") and f"pid {child.pid}" in err and err.count("\n") == 1
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_is_released_on_an_exception_and_refuses_while_held(tmp_path):
    with pytest.raises(ZeroDivisionError), RunLock(tmp_path):
        with pytest.raises(RunInUseError, match="in use by pid"):
            RunLock(tmp_path).acquire()
        1 / 0  # noqa: B018
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_garbled_lock_is_refused_while_fresh_and_taken_over_when_old(tmp_path, capsys):
    lock = tmp_path / LOCK_NAME
    lock.write_text("")  # a run killed between creating the file and writing it
    with pytest.raises(RunInUseError, match="unreadable"):
        RunLock(tmp_path).acquire()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    RunLock(tmp_path).acquire().release()
    assert "unreadable" in capsys.readouterr().err and not lock.exists()


def test_a_lock_of_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"pid": 1, "host": "elsewhere.example", "started": "2024-01-01T00:00:00+00:00"}))
    with pytest.raises(RunInUseError, match="elsewhere.example"):
        RunLock(tmp_path).acquire()


# ------------------------------------------------------------------------------- issue #46
@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_run_dir_that_is_a_file_or_inside_one_is_one_line(where, base_dir, tmp_path, capsys,
                                                            no_model_load):
    """Issue #46 case 9: ``--run_dir`` naming a file was a 22-line FileExistsError."""
    (tmp_path / "afile").write_text("keep")
    run_dir = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "run"
    assert main(["--config", str(tiny_config(tmp_path, base_dir)), "--run_dir", str(run_dir)]) == 2
    assert one_error_line(capsys).startswith(f"error: --run_dir {run_dir}: ")
    assert (tmp_path / "afile").read_text() == "keep"


def test_lightning_refusing_its_set_up_is_one_line_and_leaves_no_tb(base_dir, tmp_path, capsys):
    """Issue #46 case 8: too few documents for ``val_check_interval``: Lightning's message as a
    32-line traceback, and tb/ left in the run folder."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # a folder that existed before keeps its files
    code = main(["--config", str(tiny_config(tmp_path, base_dir)), "--run_dir", str(run),
                 "--data.init_args.n_docs", "4", "--data.init_args.val_fraction", "0.25",
                 "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "10000",
                 "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.save_dir", str(run / "tb")])
    assert code == 2
    err = capsys.readouterr().err  # the base loaded first: its progress bar comes before
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and "Traceback" not in err, lines
    assert lines[0].startswith("error: trainer: `val_check_interval` (10000) must be less than")
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------- issue #64
@pytest.mark.parametrize("kernel", ["triton"])
def test_a_cuda_only_gate_kernel_on_the_cpu_is_one_line_before_the_model_loads(
        kernel, base_dir, tmp_path, capsys, no_model_load):
    """#64 case 7: ``--model.gate.kernel triton`` on the CPU was a 176-185-line traceback from
    inside the kernel, exit 1, and RUN/tb left."""
    run = tmp_path / "run"
    code = main(["--config", str(tiny_config(tmp_path, base_dir)), "--run_dir", str(run),
                 "--model.gate.kernel", kernel,
                 "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.save_dir", str(run / "tb")])
    assert code == 2
    line = one_error_line(capsys)
    assert f"model.gate.kernel: '{kernel}' trains only on CUDA" in line
    assert "--model.gate.kernel chunked" in line
    assert not run.exists()


@pytest.mark.parametrize("ckpt_path", ["last", "ckpt/last.ckpt"])
def test_overwrite_with_ckpt_path_is_one_line_naming_both(ckpt_path, base_dir, tmp_path, capsys,
                                                         no_model_load):
    """#64 case 12: ``--overwrite --ckpt_path last`` silently ignored the contradiction."""
    folder = tmp_path / "run" / "ckpt"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(b"an earlier run's checkpoint")
    code = main(["--config", str(tiny_config(tmp_path, base_dir)), "--overwrite",
                 "--ckpt_path", str(tmp_path / "run" / ckpt_path) if "/" in ckpt_path
                 else ckpt_path])
    assert code == 2
    line = one_error_line(capsys)
    assert "--overwrite" in line and "--ckpt_path" in line and "contradicts" in line
    assert (folder / "last.ckpt").read_bytes() == b"an earlier run's checkpoint"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt"]
