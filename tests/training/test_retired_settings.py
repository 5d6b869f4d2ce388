"""Switches removed from the product (issue #62.4): no help text names them, a saved config
that asks for nothing they did still loads, and one that asks for what they did is one line
naming what replaced it, before any model loads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # train.py lives at the repo root
import train
from kvgate.cli import build_parser
from kvgate.cli.retired import retire_settings
from kvgate.cli.train import main
from kvgate.training.module import KVGateModule

# what a help text must not offer any more (gate_hybrid lives in experiments/policies now)
REMOVED = ("warmstart", "flex", "gate_hybrid")

# the recipe block and gate kernel a config saved before #62 holds (cpt_kvzap's, abridged)
SAVED = {"model": {"gate": {"kernel": "auto", "beta": 0.45},
                   "recipe": {"lm_weight": 0.0, "distill_weight": 1.0, "warmstart_steps": 0,
                              "warmstart_policy": "h2o", "warmstart_keep": 0.45}}}


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(self):
        raise AssertionError("a model was loaded although the config is refused")

    monkeypatch.setattr(KVGateModule, "configure_model", refuse)


def _helps(parser: argparse.ArgumentParser, name: str = "kvgate"):
    """(command, help text) of ``parser`` and of every subcommand below it."""
    yield name, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _helps(child, f"{name} {sub}")


def test_no_help_text_names_a_removed_switch(capsys):
    texts = dict(_helps(build_parser()))
    assert {"kvgate eval", "kvgate infer", "kvgate data oracle"} <= set(texts)
    with pytest.raises(SystemExit) as done:
        main(["--help"], prog="kvgate train")
    assert done.value.code == 0
    texts["kvgate train"] = capsys.readouterr().out
    assert "--model.recipe.oracle_weight" in texts["kvgate train"]
    for command, text in texts.items():
        found = [word for word in REMOVED if word in text]
        assert not found, f"{command} --help names {found}"


def _saved(tmp_path: Path, **changes) -> Path:
    config = json.loads(json.dumps(SAVED))
    for key, value in changes.items():
        block, name = key.split("__")
        config["model"][block][name] = value
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_saved_config_with_the_warm_start_off_still_loads(tmp_path, no_model_load):
    args = retire_settings(train.resolve_config_args(
        ["--config", "cpt_demo", "--config", str(_saved(tmp_path))]))
    cli = train.KVGateCLI(KVGateModule, train.KVGateDataModule, subclass_mode_data=True,
                          run=False, args=args, save_config_callback=None)
    assert cli.model.recipe_cfg.distill_weight == 1.0 and cli.model.recipe_cfg.lm_weight == 0.0
    assert cli.model.gate_cfg.beta == 0.45 and cli.model.gate_cfg.kernel == "auto"


def test_inert_flags_are_dropped_and_others_kept():
    assert retire_settings(["--model.recipe.warmstart_steps", "0", "--trainer.max_steps", "3",
                            "--model.recipe.warmstart_keep=0.3", "--model.gate.kernel",
                            "chunked"]) == ["--trainer.max_steps", "3", "--model.gate.kernel",
                                            "chunked"]
    assert retire_settings(["--model.recipe", '{"warmstart_steps": 0, "lm_weight": 0.5}']) == [
        "--model.recipe", '{"lm_weight": 0.5}']
    plain = ["--config", "cpt_demo", "--model.gate.kernel=triton", "--print_config"]
    assert retire_settings(plain) == plain


WARM = "model.recipe.warmstart_steps: the warm start (gates first trained on a heuristic's keep"
FLEX = "model.gate.kernel: 'flex': the block-sparse FlexAttention kernel was removed"


@pytest.mark.parametrize("extra, config, says", [
    (["--model.recipe.warmstart_steps", "30"], {}, WARM),
    (["--model.recipe.warmstart_steps=5"], {}, WARM),
    (["--model.recipe", '{"warmstart_steps": 2}'], {}, WARM),
    ([], {"recipe__warmstart_steps": 30}, WARM),
    (["--model.gate.kernel", "flex"], {}, FLEX),
    ([], {"gate__kernel": "flex"}, FLEX),
])
def test_asking_for_a_removed_behaviour_is_one_line_naming_its_replacement(
        extra, config, says, tmp_path, capsys, no_model_load):
    saved = _saved(tmp_path, **config)
    assert main(["--config", "cpt_demo", "--config", str(saved), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {says}"), lines
    if config:
        assert lines[0].endswith(f"(--config {saved})")
    if says == FLEX:
        assert "use chunked, or triton on CUDA" in lines[0]
    else:
        assert "experiments/README.md" in lines[0]
