"""A run that diverges or cannot step is stopped, not reported as trained (issue #64): a NaN
loss or tensor ends the run at that step with one line and no export; a learning rate whose
first AdamW step overflows float32 is refused before the model loads."""

from __future__ import annotations

import pytest
from kvtrain_fixtures import save_tiny_base, tiny_config

from kvgate.cli.train import main


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def error_lines(err: str) -> list[str]:
    """The ``error:`` lines of stderr (the base's progress bar and library warnings aside)."""
    return [line for line in err.splitlines() if line.startswith("error")]


def test_a_diverging_run_stops_at_the_step_with_one_line_and_exports_nothing(base_dir, tmp_path,
                                                                           capsys):
    """#64: lr_gate 1e30 turns the tiny model's gates into NaN; the run used to go on, exit 0
    and export all-NaN gates.safetensors."""
    run = tmp_path / "run"
    code = main(["--config", str(tiny_config(tmp_path, base_dir)), "--run_dir", str(run),
                 "--model.optim.lr_gate", "1e30"])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, lines
    assert lines[0].startswith("error: training stopped at step ")
    assert "lr_gate 1e+30" in lines[0] and "learning rate" in lines[0]
    assert not (run / "gated").exists()
    step = int(lines[0].split("step ")[1].split(":")[0])
    saved = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    assert f"epoch=0-step={step}.ckpt" not in saved  # the step that diverged is not kept


@pytest.mark.parametrize("flag, value", [("lr_gate", "1e38"), ("lr_lora", "5e37")])
def test_a_learning_rate_whose_first_step_overflows_is_one_line_before_the_model_loads(
        flag, value, base_dir, tmp_path, capsys, monkeypatch):
    """#64 case 15: lr_gate 1e38 was a 76-line overflow traceback from inside AdamW's first
    step, and RUN/tb left behind."""
    from kvgate.training.module import KVGateModule

    def refuse(self):
        raise AssertionError("the model was loaded although the run is refused")

    monkeypatch.setattr(KVGateModule, "configure_model", refuse)
    run = tmp_path / "run"
    code = main(["--config", str(tiny_config(tmp_path, base_dir)), "--run_dir", str(run),
                 f"--model.optim.{flag}", value,
                 "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.save_dir", str(run / "tb")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1 and f"OptimSettings.{flag}" in lines[0], lines
    assert "overflows float32" in lines[0]
    assert not run.exists()
