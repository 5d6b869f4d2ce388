"""train.py: config lookup, validation before any model loads, every shipped config, a full
run with resume and export, DeepSpeed from config, and a 2-process DDP run on the CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from kvtrain_fixtures import save_tiny_base, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # train.py lives at the repo root
import train
from kvgate.checkpoint import load_gated
from kvgate.training.data import CPTDataModule, SFTDataModule
from kvgate.training.module import KVGateModule

ROOT = Path(train.__file__).resolve().parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ABLATIONS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(self):
        raise AssertionError("a model was loaded although the config is invalid")

    monkeypatch.setattr(KVGateModule, "configure_model", refuse)


def test_bare_config_names_resolve_inside_configs():
    args = train.resolve_config_args(["--config", "cpt_demo", "--config=sft_demo_rte.yaml"])
    assert args[1] == str(ROOT / "configs" / "cpt_demo.yaml")
    assert args[2] == "--config=" + str(ROOT / "configs" / "sft_demo_rte.yaml")
    assert train.resolve_config_args(["--config", "no_such"]) == ["--config", "no_such"]


def test_every_config_line_is_commented():
    for path in CONFIGS + ABLATIONS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            body = line.split("#", 1)[0].strip()
            if body and not body.endswith(":"):
                assert "#" in line, f"{path.name}:{n} has no comment: {line!r}"


GPU_TO_CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
              "--trainer.strategy", "auto", "--trainer.precision", "32-true"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_parses_and_builds(path, no_model_load):
    raw = yaml.safe_load(path.read_text())
    extra = GPU_TO_CPU if raw["trainer"].get("accelerator") == "gpu" else []
    cli = train.KVGateCLI(KVGateModule, train.KVGateDataModule, subclass_mode_data=True,
                          run=False, args=["--config", str(path), *extra],
                          save_config_callback=None)
    model, data = cli.model, cli.datamodule
    assert model.gate_cfg.to_dict() == {**model.gate_cfg.to_dict(), **raw["model"]["gate"]}
    if path.stem.startswith("sft"):
        assert isinstance(data, SFTDataModule)
        assert (model.gate_cfg.tau, model.gate_cfg.gamma, model.gate_cfg.beta) == (0.3, 0.0, 0.28)
        assert model.gate_cfg.mode == "prompt_bidirectional"
    else:
        assert isinstance(data, CPTDataModule) and model.gate_cfg.mode == "causal"
    if "redpajama" in path.stem:
        g = model.gate_cfg
        assert (g.tau, g.gamma, g.alpha, g.beta) == (0.5, 2.0, 5.0, 0.4)
        strategy = raw["trainer"]["strategy"]
        assert strategy["class_path"].endswith("DeepSpeedStrategy")
        assert strategy["init_args"] == {"stage": 2, "exclude_frozen_parameters": True}
        assert raw["trainer"]["precision"] == "bf16-mixed" and raw["trainer"]["devices"] == 4


@pytest.mark.parametrize("path", ABLATIONS, ids=[p.stem for p in ABLATIONS])
def test_ablation_variants_layer_on_the_recipe(path, no_model_load, monkeypatch):
    """Each ablation file changes only its switches (over the layers its header's command puts
    under it), and its header's --run_dir moves every output to the variant's own folder."""
    # a variant may start from another variant's export, which a fresh clone has not trained
    monkeypatch.setattr("kvgate.training.module.check_init_from", lambda path, train: None)
    header = " ".join(line.lstrip("#").strip().rstrip("\\") for line in
                      path.read_text().splitlines() if line.startswith("#"))
    command = header.split("python train.py", 1)[1].split(" #")[0]
    layers = re.findall(r"--config (\S+)", command)
    # the recipe a variant starts from: cpt_recipe for the ablations (runs/abl_NAME), the main
    # job's for issue #65's levers (runs/NAME)
    assert (ROOT / "configs" / f"{layers[0]}.yaml").is_file(), layers
    assert layers[-1] == f"experiments/configs/{path.name}", layers
    out = f"runs/abl_{path.stem}" if layers[0] == "cpt_recipe" else f"runs/{path.stem}"
    assert re.findall(r"--run_dir (\S+)", command) == [out], command

    def build(*extra, run_dir=None):
        args = [arg for layer in extra for arg in ("--config", layer)]
        return train.KVGateCLI(KVGateModule, train.KVGateDataModule, subclass_mode_data=True,
                               run=False, save_config_callback=None, args=train.resolve_config_args(
                                   args + (["--run_dir", run_dir] if run_dir else [])))
    recipe, variant = build(*layers[:-1]), build(*layers, run_dir=out)
    assert variant.trainer.default_root_dir == out
    dirs = [str(getattr(c, "dirpath", "")) for c in variant.trainer.callbacks]
    assert any(d.endswith(f"{out}/checkpoints") for d in dirs) and f"{out}/gated" in dirs
    raw = yaml.safe_load(path.read_text()).get("model") or {}  # a variant may change data only
    for block in ("gate", "recipe", "optim"):
        got = getattr(variant.model, f"{block}_cfg")
        want = getattr(recipe.model, f"{block}_cfg")
        changed = {k for k in vars(want) if getattr(got, k) != getattr(want, k)}
        assert changed == {k for k, v in raw.get(block, {}).items() if getattr(want, k) != v}
    assert variant.model.init_from == raw.get("init_from", recipe.model.init_from)


@pytest.mark.parametrize("override, key", [
    (["--model.gate.beta", "0.9"], "GateConfig.beta"),
    (["--model.gate.kind", "conv"], "model.gate.kind"),
    (["--model.gate.kind", "mlp", "--model.gate.hidden", "0"], "GateConfig.hidden"),
    (["--model.lora.rank", "0"], "LoraSettings.rank"),
    (["--model.optim.warmup_ratio", "2"], "OptimSettings.warmup_ratio"),
    (["--data.seq_len", "1"], "data.seq_len"),
    (["--model.init_from", "runs/nowhere/gated"], "KVGateModule.init_from"),
])
def test_invalid_values_fail_before_loading_and_name_the_key(override, key, no_model_load, capsys):
    assert train.main(["--config", "cpt_demo", *override]) == 2
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1


def test_deepspeed_strategy_comes_from_the_config(no_model_load):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    raw = yaml.safe_load((ROOT / "configs" / "cpt_redpajama.yaml").read_text())
    strategy = DeepSpeedStrategy(**raw["trainer"]["strategy"]["init_args"])
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy.exclude_frozen_parameters


def test_missing_deepspeed_names_the_fix(monkeypatch, capsys, no_model_load):
    real = importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert train.main(["--config", "cpt_redpajama"]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeedStrategy" in err and "kvgate[deepspeed]" in err


def test_deepspeed_zero2_trains_checkpoints_and_exports_on_the_cpu(base_dir, tmp_path):
    """A few ZeRO-2 steps through train.py (gloo, DeepSpeed's cpu accelerator): the checkpoint
    folder holds no frozen base tensor and consolidates into the same gates the run exported."""
    config = tiny_config(tmp_path, base_dir, max_steps=3, gradient_clip_val=1.0)
    extensions = tmp_path / "torch_extensions"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(extensions))
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(here), str(here.parent),
                                         env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(config),
         "--trainer.strategy", "deepspeed_cpu"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # nothing compiled at run time (a CI run timed out while DeepSpeed built its shm op)
    assert not extensions.exists() or not any(extensions.rglob("*")), sorted(extensions.rglob("*"))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert ckpt.is_dir()  # DeepSpeed's sharded checkpoint layout
    saved = {}
    for f in ckpt.rglob("*model_states.pt"):
        saved.update(torch.load(f, map_location="cpu", weights_only=False)["module"])
    assert saved and all("kv_gate" in k or "lora_" in k for k in saved), sorted(saved)[:5]

    from kvgate.training.export import module_from_checkpoint

    module = module_from_checkpoint(ckpt).eval()
    model, _, meta = load_gated(tmp_path / "run" / "gated", merge_lora=False)
    assert meta["training"]["global_step"] == 3
    ids = torch.randint(4, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_zero = module(ids, torch.ones_like(ids))
        exported = model(input_ids=ids).logits
    torch.testing.assert_close(from_zero, exported)


def test_cpu_deepspeed_refuses_zero3():
    from kvgate.training.errors import TrainingConfigError
    from kvgate.training.strategies import CPUDeepSpeedStrategy

    with pytest.raises(TrainingConfigError, match="ZeRO stage 3"):
        CPUDeepSpeedStrategy(stage=3)


def test_cli_run_resumes_and_exports(base_dir, tmp_path):
    config = tiny_config(tmp_path, base_dir)
    assert train.main(["--config", str(config)]) == 0
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 3
    assert train.main(["--config", str(config), "--trainer.max_steps", "5",
                       "--ckpt_path", "last"]) == 0
    state = torch.load(ckpt, weights_only=True)
    assert state["global_step"] == 5
    assert state["SyntheticCPT"]["batches"] == 5  # the data position travels too
    _, _, meta = load_gated(tmp_path / "run" / "gated")
    assert meta["training"]["global_step"] == 5 and meta["gate"]["beta"] == 0.3


def test_two_process_ddp_on_the_cpu(base_dir, tmp_path):
    config = tiny_config(tmp_path, base_dir, max_steps=2)
    env = dict(os.environ)
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(here), str(here.parent),
                                         env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # two ranks share two cores
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(config),
         "--trainer.strategy", "ddp", "--trainer.devices", "2"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 2
    _, _, meta = load_gated(tmp_path / "run" / "gated")
    assert meta["training"]["global_step"] == 2


@pytest.mark.parametrize("logger", [False, True])
def test_run_refused_at_build_leaves_no_folder_behind(base_dir, tmp_path, capsys, logger):
    # the tiny model's heads are 16 wide: a 64-wide rotary gate is refused when the gates go in
    # (configure_model, inside fit), after the logger and the config saver have their folder
    config = tiny_config(tmp_path, base_dir)
    extra = ["--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
             "--trainer.logger.save_dir", str(tmp_path / "run" / "tb")] if logger else []
    code = train.main(["--config", str(config), "--model.gate.head_dim", "64", *extra])
    assert code == 2
    assert "GateConfig.head_dim: 64 exceeds this model's rotary dimension 16" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()  # a folder that was there before the run is left alone
    assert train.main(["--config", str(config), "--model.gate.head_dim", "64", *extra]) == 2
    assert (tmp_path / "run").is_dir()


def test_run_dir_moves_every_output_and_changes_nothing_else(no_model_load):
    """A seed variant is the recipe's layers plus --seed_everything and --run_dir: the same
    run in every setting but the seed and the folders it writes to."""
    layers = ["--config", "cpt_recipe", "--config", "experiments/configs/recent64_256.yaml"]

    def build(*extra):
        return train.KVGateCLI(KVGateModule, train.KVGateDataModule, subclass_mode_data=True,
                               run=False, args=train.resolve_config_args([*layers, *extra]),
                               save_config_callback=None)
    plain = build()
    moved = build("--seed_everything", "3", "--run_dir", "runs/elsewhere")
    assert moved.trainer.default_root_dir == "runs/elsewhere"
    assert moved.trainer.logger.save_dir == "runs/elsewhere"
    dirs = {type(c).__name__: str(getattr(c, "dirpath", None)) for c in moved.trainer.callbacks}
    assert dirs["ModelCheckpoint"].endswith("runs/elsewhere/checkpoints")
    assert dirs["ExportGated"] == "runs/elsewhere/gated"
    assert moved.config.seed_everything == 3
    for block in ("gate_cfg", "recipe_cfg", "optim_cfg", "lora_cfg"):
        assert getattr(moved.model, block) == getattr(plain.model, block)
    assert (moved.datamodule.seq_len, moved.datamodule.max_docs, moved.datamodule.seed) == \
        (plain.datamodule.seq_len, plain.datamodule.max_docs, plain.datamodule.seed)


def test_run_dir_refuses_a_callback_it_cannot_move(base_dir, tmp_path, capsys):
    config = tiny_config(tmp_path, base_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"]["callbacks"].append({"class_path": "kvtrain_fixtures.FolderWriter"})
    config.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(config), "--run_dir", str(tmp_path / "moved")]) == 2
    assert "FolderWriter, which writes to a folder --run_dir does not know" in capsys.readouterr().err
    assert not (tmp_path / "moved").exists() and not (tmp_path / "run").exists()


def test_run_dir_puts_a_whole_run_in_its_folder(base_dir, tmp_path):
    config = tiny_config(tmp_path, base_dir, max_steps=2)
    out = tmp_path / "seed1"
    assert train.main(["--config", str(config), "--seed_everything", "1",
                       "--run_dir", str(out)]) == 0
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    _, _, meta = load_gated(out / "gated")
    assert meta["training"]["global_step"] == 2
    assert not (tmp_path / "run").exists()  # the config's own folders were not touched
