"""The ``kvgate`` command: its subcommands, one-line user errors (exit 2), --debug, the typed
eval configs, and the old entry points (train.py, infer.py, python -m kvgate.eval) agreeing
with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, build, load_script, tiny_llama_config

import kvgate.cli.train  # Lightning's log handler takes the real stderr on import, not capsys's
import kvgate.eval.commands
from kvgate.cli import main
from kvgate.eval.benchmarks.mc.config import MatchedConfig, MCConfig
from kvgate.eval.benchmarks.needle.config import NeedleConfig
from kvgate.eval.benchmarks.ppl.config import PPLConfig
from kvgate.eval.errors import EvalError
from kvgate.policies.base import Budget

COMMANDS = ("train", "infer", "eval", "export", "prepare", "data")


class CharTokenizer:
    """One token per character (ids 3..127, inside the tiny model's vocabulary)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=True):
        ids = [self.bos_token_id] if add_special_tokens else []
        return {"input_ids": ids + [3 + ord(c) % 125 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.fixture
def no_model(monkeypatch):
    def refuse(cfg):
        raise AssertionError("the model must not load when the arguments are wrong")

    monkeypatch.setattr(kvgate.eval.commands, "load_model", refuse)


def test_help_lists_every_command(capsys):
    out = help_text(capsys)
    for name in COMMANDS:
        assert f"    {name} " in out, name


@pytest.mark.skipif(shutil.which("kvgate") is None, reason="the kvgate script is not installed")
def test_the_installed_script():
    done = subprocess.run(["kvgate", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and all(f"    {n} " in done.stdout for n in COMMANDS)
    done = subprocess.run(["kvgate", "eval", "mc", "--model", "x", "--out", "o", "--budgets",
                           "1.5"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --budgets: budget ratio must lie in (0, 1]")
    assert done.stderr.count("\n") == 1


def test_python_dash_m_kvgate_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "kvgate", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0 and "    prepare " in done.stdout


def test_eval_subcommands_and_their_help(capsys):
    out = help_text(capsys, "eval")
    for name in ("mc", "matched", "needle", "ppl", "pattern", "report"):
        assert name in out
    out = help_text(capsys, "eval", "mc")
    assert "--budgets" in out and "--num-fewshot" in out and "--reference" not in out
    assert "--reference-budget" in help_text(capsys, "eval", "matched")
    assert "--merge" in help_text(capsys, "export")
    assert "--prompt-file" in help_text(capsys, "infer")


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "abc"], "--budgets: budget 'abc' is neither a ratio nor a token count"),
    (["--policies", "full,snapcv"], "--policies: unknown policy 'snapcv'"),
    (["--policies", "snapkv", "--policy-opt", "snapkv.windw=4"], "--policy-opt: policy 'snapkv'"),
    (["--tasks", "rte,nope"], "--tasks: unknown task 'nope'"),
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--patterns", "-1"], "--patterns must be >= 0, got -1"),
])
def test_a_bad_value_is_one_line_and_exit_2(capsys, no_model, tmp_path, argv, message):
    code, _, err = run(capsys, "eval", "mc", "--model", "x", "--out", str(tmp_path), *argv)
    assert code == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_debug_shows_the_traceback(no_model, tmp_path):
    with pytest.raises(EvalError, match="--budgets"):
        main(["eval", "mc", "--model", "x", "--out", str(tmp_path), "--budgets", "abc",
              "--debug"])


def test_usage_errors_stay_argparse_errors(capsys, tmp_path):
    for argv in (["eval", "mc", "--out", str(tmp_path)],          # neither --model nor --checkpoint
                 ["eval", "mc", "--model", "x", "--out", "o", "--mode", "fast"],
                 ["nope"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "usage:" in capsys.readouterr().err


def test_other_commands_print_one_line(capsys, monkeypatch, tmp_path):
    import kvgate.models

    monkeypatch.setattr(kvgate.models, "load_base", lambda *a, **k: pytest.fail("loaded"))
    code, _, err = run(capsys, "infer", "--model", "x", "--prompt", "hi", "--budget", "1.5")
    assert code == 2 and err.startswith("error: budget ratio must lie in (0, 1]")
    code, _, err = run(capsys, "prepare", "no-such-model")
    assert code == 2 and err.startswith("error: unknown embedded model 'no-such-model'")
    code, _, err = run(capsys, "export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out"))
    assert code == 2 and "no such checkpoint file" in err and err.count("\n") == 1


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available() or torch.version.cuda is not None,
                              reason="a CUDA build of torch")


@pytest.mark.parametrize("device, message", [
    pytest.param("cuda", "device 'cuda': this torch is built without CUDA (CPU only); use "
                 "--device cpu", marks=CPU_ONLY),
    pytest.param("cuda:1", "device 'cuda:1': this torch is built without CUDA", marks=CPU_ONLY),
    ("gpu", "device 'gpu' is not a device torch knows; use cpu, cuda, cuda:N or mps"),
])
@pytest.mark.parametrize("command", [
    ["infer", "--model", "x", "--prompt", "hi"],
    ["eval", "mc", "--model", "x", "--tasks", "copa"],
    ["eval", "matched", "--checkpoint", "c"],
    ["eval", "needle", "--model", "x"],
    ["eval", "ppl", "--model", "x"],
    ["eval", "pattern", "--checkpoint", "c"],
])
def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch, no_model, tmp_path,
                                                 command, device, message):
    """Issue 36, case 8: --device cuda on a CPU-only torch ended in a 39-line traceback."""
    import kvgate.models

    monkeypatch.setattr(kvgate.models, "load_base", lambda *a, **k: pytest.fail("loaded"))
    out = ["--out", str(tmp_path)] if command[0] == "eval" else []
    code, _, err = run(capsys, *command, *out, "--device", device)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1


@CPU_ONLY
def test_load_base_refuses_a_missing_device_before_reading_anything(tmp_path):
    from kvgate.models import ModelLoadError, load_base

    with pytest.raises(ModelLoadError, match="device 'cuda': this torch is built without CUDA"):
        load_base(str(tmp_path / "no-such-model"), device="cuda")


# ---------------------------------------------------------------------------------------------
# typed eval configs


def test_configs_take_strings_or_sequences_and_keep_the_flag_defaults():
    cfg = MCConfig(out="o", model="m", tasks=["copa"], budgets=[0.5, 128])
    assert cfg.budgets == [Budget(ratio=0.5), Budget(tokens=128)] and cfg.tasks == ["copa"]
    assert MCConfig(out="o", model="m", budgets="0.5,128").budgets == cfg.budgets
    assert cfg.policies == ["full", "snapkv", "h2o"] and cfg.batch_size == 8
    assert cfg.mode == "masked" and cfg.progress and cfg.limit is None
    matched = MatchedConfig(out="o", checkpoint="c")
    assert matched.policies == ["snapkv", "h2o"] and matched.reference_label == "attention_gate"
    needle = NeedleConfig(out="o", model="m", lengths="256,512", depths=[0, 50])
    assert needle.lengths == [256, 512] and needle.depths == [0.0, 50.0]
    assert PPLConfig(out="o", model="m").max_length == 512


@pytest.mark.parametrize("make, message", [
    (lambda: MCConfig(out="o"), "give one of --model or --checkpoint"),
    (lambda: MCConfig(out="o", model="m", checkpoint="c"), "give one of --model or --checkpoint"),
    (lambda: MCConfig(out="o", model="m", mode="fast"), "--mode must be one of masked, cache"),
    (lambda: NeedleConfig(out="o", model="m", lengths="1k"), "--lengths"),
    (lambda: NeedleConfig(out="o", model="m", scoring="exact"), "--scoring"),
    (lambda: PPLConfig(out="o", model="m", prefix=1.0), "--prefix must lie in (0, 1)"),
    (lambda: PPLConfig(out="o", model="m", context=0), "--context must be >= 1"),
    (lambda: MatchedConfig(out="o", model="m", others_on="base"), "--others-on base needs"),
    (lambda: MatchedConfig(out="o", checkpoint="c", rounding="down"), "--rounding"),
    (lambda: MatchedConfig(out="o", checkpoint="c", reference="ag=attention_gate",
                           policy_opt=["ag.tau=2"]), "--policy-opt: attention_gate.tau"),
])
def test_config_checks_name_the_flag(make, message):
    with pytest.raises(EvalError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_kvgate_eval_runs_a_config_end_to_end(capsys, monkeypatch, tmp_path):
    model = build(tiny_llama_config())
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, CharTokenizer(), {"model": "tiny", "checkpoint": None}))
    text = tmp_path / "texts.txt"
    text.write_text("the quick brown fox jumps over the lazy dog again and again")
    code, out, err = run(capsys, "eval", "ppl", "--model", "x", "--out", str(tmp_path / "o"),
                         "--policies", "full,window", "--budgets", "0.5", "--text-files",
                         str(text), "--max-length", "24", "--no-progress")
    assert code == 0, err
    results = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    assert sorted(results) == ["ppl|corpus|full|none|masked", "ppl|corpus|window|0.5|masked"]
    assert "| corpus | window | 0.5 | masked |" in out
    # the alias writes the same keys into another folder, and `report` redraws from the JSON
    import kvgate.eval.__main__ as alias

    assert alias.main(["ppl", "--model", "x", "--out", str(tmp_path / "a"), "--policies",
                       "full,window", "--text-files", str(text), "--max-length", "24",
                       "--no-progress"]) == 0
    again = json.loads((tmp_path / "a" / "results.json").read_text())["results"]
    assert {k: v["ppl"] for k, v in again.items()} == {k: v["ppl"] for k, v in results.items()}
    capsys.readouterr()
    code, out, _ = run(capsys, "eval", "report", "--out", str(tmp_path / "o"))
    assert code == 0 and "| corpus | full | none | masked |" in out


# ---------------------------------------------------------------------------------------------
# train.py / infer.py are the same functions


def test_kvgate_train_accepts_what_train_py_accepts(capsys):
    train = load_script("train.py")
    argv = ["--config", "cpt_demo", "--trainer.max_steps", "3", "--print_config"]
    outputs = []
    for entry in (lambda: main(["train", *argv]), lambda: train.main(argv)):
        with pytest.raises(SystemExit) as exit_info:
            entry()
        assert exit_info.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "max_steps: 3" in outputs[0]


def test_kvgate_train_refuses_a_bad_value_in_one_line(capsys, monkeypatch):
    from kvgate.training import KVGateModule

    monkeypatch.setattr(KVGateModule, "configure_model", lambda self: pytest.fail("loaded"))
    code, _, err = run(capsys, "train", "--config", "cpt_demo", "--model.gate.beta", "0.9")
    assert code == 2 and "GateConfig.beta" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_kvgate_infer_on_the_embedded_model(capsys):
    argv = ["--model", "smollm2-135m", "--policy", "snapkv", "--budget", "0.5", "--prompt",
            "The capital of France is", "--max-new-tokens", "3", "--json"]
    code, out, err = run(capsys, "infer", *argv)
    assert code == 0, err
    data = json.loads(out)
    assert len(data["texts"]) == 1 and 1 <= len(data["token_ids"][0]) <= 3
    assert 0.0 < data["stats"]["kept_fraction"] <= 0.75
    assert load_script("infer.py").main(argv) == 0  # the root script: the same run
    assert json.loads(capsys.readouterr().out)["token_ids"] == data["token_ids"]


@pytest.mark.parametrize("command", [("infer", "--prompt", "hi"),
                                     ("eval", "calibrate", "--out", "{out}"),
                                     ("eval", "mc", "--tasks", "rte", "--out", "{out}")],
                         ids=["infer", "eval calibrate", "eval mc"])
@pytest.mark.parametrize("kind", ["ckpt", "deepspeed"])
def test_a_training_checkpoint_at_checkpoint_names_the_export_to_run(command, kind, capsys,
                                                                     monkeypatch, tmp_path):
    """#64 case 5: ``--checkpoint RUN/checkpoints/last.ckpt`` said "no such checkpoint folder"
    of a file that exists."""
    import kvgate.models

    monkeypatch.setattr(kvgate.models, "load_base", lambda *a, **k: pytest.fail("loaded"))
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    if kind == "ckpt":
        ckpt = folder / "last.ckpt"
        torch.save({"global_step": 3, "state_dict": {}}, ckpt)
    else:  # a DeepSpeed checkpoint folder
        ckpt = folder / "last.ckpt"
        (ckpt / "checkpoint").mkdir(parents=True)
        (ckpt / "latest").write_text("checkpoint")
    argv = [a.format(out=tmp_path / "out") for a in command]
    code, _, err = run(capsys, *argv, "--checkpoint", str(ckpt))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {ckpt}: a training checkpoint (written by kvgate train)")
    assert f"`kvgate export {ckpt} OUT`" in err
    assert not (tmp_path / "out").exists()
