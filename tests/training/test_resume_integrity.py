"""Lightning checkpoints that survive kills and damage (issue #36, cases 4 and 6): every
checkpoint has a sha256 sidecar, checked on resume and on export; ``--ckpt_path last`` resumes
from the newest valid checkpoint of the run, also when a kill came before ``last.ckpt``."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from kvtrain_fixtures import save_tiny_base, tiny_config, with_callback

from kvgate.checkpoint import CheckpointError, load_gated
from kvgate.cli.export import main as export_main
from kvgate.cli.train import main
from kvgate.training.export import export_checkpoint
from kvgate.training.integrity import newest_checkpoint, sidecar_path, write_sidecar
from kvgate.training.runlock import LOCK_NAME


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """A 3-step run into run/ (checkpoints every step); ``--ckpt_path last`` on a fresh folder
    starts from step 0 and says so. Returns (config, run folder, stderr of the run)."""
    root = tmp_path_factory.mktemp("trained")
    config = tiny_config(root, base_dir)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--config", str(config), "--run_dir", str(root / "run"), "--ckpt_path", "last"])
    assert code == 0, err.getvalue()
    return config, root / "run", err.getvalue()


def copy_run(trained, tmp_path) -> Path:
    shutil.copytree(trained[1], tmp_path / "run")
    return tmp_path / "run"


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[:5]
    return lines[0]


def fake_checkpoint(path: Path, step: int, sidecar: bool = True, mtime: float | None = None):
    torch.save({"global_step": step, "state_dict": {}, "hyper_parameters": {}}, path)
    if sidecar:
        write_sidecar(path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


# ----------------------------------------------------------------------------- case 4
def test_a_fresh_run_with_ckpt_path_last_says_it_starts_from_step_0(trained):
    _, run, err = trained
    assert "--ckpt_path last: no checkpoint" in err and "starting from step 0" in err
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert not (run / LOCK_NAME).exists()  # the run's lock went with it


def test_last_resumes_from_the_step_checkpoint_a_kill_left_before_last_ckpt(trained, tmp_path,
                                                                            capsys):
    config = trained[0]
    run = copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / "last.ckpt").unlink()  # killed after epoch=0-step=3.ckpt, before last.ckpt
    sidecar_path(ckpts / "last.ckpt").unlink()
    assert main(["--config", str(config), "--run_dir", str(run), "--ckpt_path", "last",
                 "--trainer.max_steps", "5"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {ckpts / 'epoch=0-step=3.ckpt'} (global step 3)" in err
    state = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert state["global_step"] == 5 and state["SyntheticCPT"]["batches"] == 5
    assert not [p.name for p in ckpts.iterdir() if "-v" in p.name]  # no ...-v1.ckpt pair
    assert load_gated(run / "gated", verify=True)[2]["training"]["global_step"] == 5


def test_last_is_the_newest_valid_checkpoint_by_step_then_time(tmp_path, capsys):
    now = 1_700_000_000
    fake_checkpoint(tmp_path / "last.ckpt", 2, mtime=now + 50)  # newest file, older step
    fake_checkpoint(tmp_path / "epoch=0-step=3.ckpt", 3, mtime=now)
    fake_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4, sidecar=False, mtime=now + 10)
    fake_checkpoint(tmp_path / "epoch=0-step=5.ckpt", 5, mtime=now + 20)
    data = bytearray((tmp_path / "epoch=0-step=5.ckpt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / "epoch=0-step=5.ckpt").write_bytes(bytes(data))  # flipped after its sidecar
    assert newest_checkpoint([tmp_path]) == (tmp_path / "epoch=0-step=4.ckpt", 4)
    err = capsys.readouterr().err.strip().splitlines()
    assert any("epoch=0-step=5.ckpt" in line and "sha256" in line for line in err), err
    assert any("epoch=0-step=4.ckpt" in line and "no sidecar" in line for line in err), err
    fake_checkpoint(tmp_path / "epoch=0-step=4b.ckpt", 4, mtime=now + 30)  # same step, newer
    assert newest_checkpoint([tmp_path]) == (tmp_path / "epoch=0-step=4b.ckpt", 4)


def test_last_with_only_damaged_checkpoints_is_refused(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoint"):
        newest_checkpoint([tmp_path])
    assert newest_checkpoint([tmp_path / "nowhere"]) is None


# ----------------------------------------------------------------------------- case 6
def test_every_checkpoint_has_a_matching_sha256_sidecar(trained):
    import hashlib

    ckpts = trained[1] / "checkpoints"
    files = sorted(p.name for p in ckpts.iterdir())
    # the older step checkpoints were removed by ModelCheckpoint, and their sidecars with them
    assert files == ["epoch=0-step=3.ckpt", "epoch=0-step=3.ckpt.sha256", "last.ckpt",
                     "last.ckpt.sha256"]
    for name in ("epoch=0-step=3.ckpt", "last.ckpt"):
        digest = hashlib.sha256((ckpts / name).read_bytes()).hexdigest()
        assert (ckpts / f"{name}.sha256").read_text() == f"{digest}  {name}\n"  # sha256sum -c


def flipped_copy(trained, tmp_path, sidecar: bool = True) -> Path:
    src = trained[1] / "checkpoints" / "last.ckpt"
    dst = tmp_path / "last.ckpt"
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0x10
    dst.write_bytes(bytes(data))
    if sidecar:
        shutil.copy(sidecar_path(src), sidecar_path(dst))
    return dst


def test_a_bit_flipped_checkpoint_is_not_exported(trained, tmp_path, capsys):
    ckpt = flipped_copy(trained, tmp_path)
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert str(ckpt) in line and "sha256" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "truncated_no_sidecar", "missing"])
def test_a_damaged_resume_checkpoint_is_one_line_and_leaves_no_folder(damage, trained,
                                                                      tmp_path, capsys):
    if damage == "flipped":
        ckpt = flipped_copy(trained, tmp_path)
    else:
        ckpt = tmp_path / "last.ckpt"
        if damage != "missing":
            data = (trained[1] / "checkpoints" / "last.ckpt").read_bytes()
            ckpt.write_bytes(data[: len(data) // 2])
        if damage == "truncated":
            shutil.copy(sidecar_path(trained[1] / "checkpoints" / "last.ckpt"), sidecar_path(ckpt))
    new = tmp_path / "new"
    code = main(["--config", str(trained[0]), "--run_dir", str(new), "--ckpt_path", str(ckpt),
                 "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.save_dir", str(new / "tb")])
    assert code == 2
    line = one_error_line(capsys)
    assert str(ckpt) in line
    assert not new.exists()  # validated before the logger made tb/ (or anything else)


def test_a_checkpoint_without_sidecar_exports_with_a_warning(trained, tmp_path, capsys):
    ckpt = tmp_path / "old.ckpt"
    shutil.copy(trained[1] / "checkpoints" / "last.ckpt", ckpt)  # as written before sidecars
    out = export_checkpoint(ckpt, tmp_path / "out")
    ours = [line for line in capsys.readouterr().err.splitlines() if str(ckpt) in line]
    assert len(ours) == 1 and ours[0].startswith("warning: ") and "no sidecar" in ours[0], ours
    assert load_gated(out)[2]["training"]["global_step"] == 3


def test_a_checkpoint_of_step_0_is_not_exported(trained, tmp_path):
    state = torch.load(trained[1] / "checkpoints" / "last.ckpt", weights_only=True)
    state["global_step"] = 0
    ckpt = tmp_path / "step0.ckpt"
    torch.save(state, ckpt)
    write_sidecar(ckpt)
    with pytest.raises(CheckpointError, match="global_step 0"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_export_typo_over_the_run_folder_deletes_nothing(trained, tmp_path, capsys):
    """Issue #46: ``kvgate export RUN/checkpoints/last.ckpt RUN --overwrite`` (for RUN/gated)
    exited 0 and replaced the whole run folder, every checkpoint included."""
    run = copy_run(trained, tmp_path)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert export_main([str(run / "checkpoints" / "last.ckpt"), str(run), "--overwrite"]) == 2
    line = one_error_line(capsys)
    assert "holds the checkpoint being exported" in line and str(run / "gated") in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary left beside it


# ------------------------------------------------------------------------------- issue #46
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_a_step_with_a_checkpoint_that_resumes_to_the_same_run(
        signum, status, trained, tmp_path, capsys):
    """Issue #46 case 10: ``kill -TERM`` on a running ``kvgate train`` exited 0 with no
    checkpoint and no message. Now: the step ends, stopped.ckpt is written, one line, 143
    (130 for Ctrl-C); ``--ckpt_path last`` resumes from it to the uninterrupted run's tensors."""
    config, done, _ = trained
    killed = with_callback(config, {"class_path": "kvtrain_fixtures.SignalAt",
                                    "init_args": {"step": 1, "signum": int(signum)}},
                           tmp_path / "killed.yaml")
    run = tmp_path / "run"
    # what the test process had (a shell's background job starts with SIGINT ignored)
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    assert main(["--config", str(killed), "--run_dir", str(run)]) == status
    stopped = run / "checkpoints" / "stopped.ckpt"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == f"stopped at step 2; resume with --ckpt_path last (checkpoint {stopped})"
    assert torch.load(stopped, weights_only=True)["global_step"] == 2
    assert sidecar_path(stopped).is_file() and not (run / "gated").exists()  # nothing exported
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # put back
    if signum != signal.SIGTERM:
        return
    assert main(["--config", str(config), "--run_dir", str(run), "--ckpt_path", "last"]) == 0
    assert f"resuming from {stopped} (global step 2)" in capsys.readouterr().err
    resumed = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    whole = torch.load(done / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == whole["global_step"] == 3
    assert resumed["state_dict"].keys() == whole["state_dict"].keys()
    for name, tensor in whole["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], tensor), name


def test_a_run_folder_holding_checkpoints_needs_ckpt_path_or_overwrite(trained, tmp_path,
                                                                       capsys):
    """Issue #46 case 11: a second run into a killed run's folder, without --ckpt_path,
    started at step 0 and wrote ``*-v1.ckpt`` beside the old files."""
    run = copy_run(trained, tmp_path)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert main(["--config", str(trained[0]), "--run_dir", str(run)]) == 2
    line = one_error_line(capsys)
    assert f"{run / 'checkpoints'} already holds 2 checkpoint(s)" in line
    assert "--ckpt_path last" in line and "--run_dir" in line and "--overwrite" in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert main(["--config", str(trained[0]), "--run_dir", str(run), "--overwrite",
                 "--trainer.max_steps", "2"]) == 0
    assert "deleted 2 checkpoint(s) of an earlier run" in capsys.readouterr().err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=2.ckpt.sha256", "last.ckpt",
                     "last.ckpt.sha256"]  # no -v1 pair, nothing of the earlier run


@pytest.mark.parametrize("override, field", [
    (["--model.gate.heads", "2"], "model.gate.heads 4, this run has 2"),
    (["--model.gate.kind", "mlp"], "model.gate.kind 'attention', this run has 'mlp'"),
    (["--model.lora.rank", "8"], "model.lora.rank 4, this run has 8"),
    (["--model.train", "gates"], "model.train 'gates_lora', this run has 'gates'"),
])
def test_a_resume_checkpoint_of_other_shapes_is_one_line_before_fit(override, field, trained,
                                                                    tmp_path, capsys):
    """Issue #46 case 7: resuming with another gate size ended in a 154-line size-mismatch
    traceback and left tb/version_0."""
    run = copy_run(trained, tmp_path)
    code = main(["--config", str(trained[0]), "--run_dir", str(run), "--ckpt_path", "last",
                 "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.save_dir", str(run / "tb"), *override])
    assert code == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --ckpt_path {run / 'checkpoints'}") and field in line
    assert not (run / "tb").exists()  # refused before fit made the logger's folder


# ------------------------------------------------------------------------------- issue #64
def test_a_damaged_last_ckpt_is_set_aside_so_the_resumed_run_writes_a_good_one(trained, tmp_path,
                                                                               capsys):
    """#64 case 10: resuming past a 0-byte last.ckpt wrote last-v1.ckpt beside it, and the
    documented ``kvgate export RUN/checkpoints/last.ckpt`` read the damaged one."""
    config = trained[0]
    run = copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / "last.ckpt").write_bytes(b"")  # a full disk; its sidecar is of the old file
    assert main(["--config", str(config), "--run_dir", str(run), "--ckpt_path", "last",
                 "--trainer.max_steps", "5"]) == 0
    names = sorted(p.name for p in ckpts.iterdir())
    assert not [n for n in names if "-v" in n], names  # no last-v1.ckpt beside it
    err = capsys.readouterr().err
    assert f"resuming from {ckpts / 'epoch=0-step=3.ckpt'} (global step 3)" in err
    assert f"warning: {ckpts / 'last.ckpt'} is damaged: renamed last.ckpt.damaged" in err
    assert "last.ckpt.damaged" in names and (ckpts / "last.ckpt.damaged").stat().st_size == 0
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 5
    assert export_main([str(ckpts / "last.ckpt"), str(tmp_path / "out")]) == 0
    assert load_gated(tmp_path / "out")[2]["training"]["global_step"] == 5


@pytest.mark.parametrize("sidecar", [True, False])
def test_an_export_of_a_damaged_checkpoint_names_the_valid_one_beside_it(sidecar, trained,
                                                                         tmp_path, capsys):
    """#64 case 10: the refusal of a damaged last.ckpt did not name the last-v1.ckpt that an
    earlier resume had written beside it."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    good = trained[1] / "checkpoints" / "last.ckpt"
    shutil.copy(good, folder / "last-v1.ckpt")
    write_sidecar(folder / "last-v1.ckpt")
    fake_checkpoint(folder / "epoch=0-step=1.ckpt", 1)  # valid, but an older step
    (folder / "last.ckpt").write_bytes(b"")
    if sidecar:
        shutil.copy(sidecar_path(good), sidecar_path(folder / "last.ckpt"))
    assert export_main([str(folder / "last.ckpt"), str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {folder / 'last.ckpt'}: ")
    assert ("the newest valid checkpoint beside it is last-v1.ckpt (global step 3): "
            f"kvgate export {folder / 'last-v1.ckpt'} OUT") in line
    assert not (tmp_path / "out").exists()
