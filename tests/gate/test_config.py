"""``GateConfig`` from the registry of kinds (issue #63) and the removed ``previous_layer``
(#62): each kind reads a dataclass of its own fields; the flat form that run configs and
exports write keeps loading (another kind's fields at their defaults, the legacy ``head_dim``
of configs/cpt_kvzap.yaml, ``previous_layer: false``), and a value that would be silently
unread is one line naming the field and the kind."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from conftest import build, tiny_llama_config

import kvgate.gate
from kvgate.checkpoint import CONFIG_NAME, CheckpointError, export_gated, load_gated
from kvgate.gate import (
    GATE_KINDS,
    GATES,
    ConfigError,
    GateConfig,
    KindSettings,
    gate_modules,
    patch,
)
from kvgate.gate.settings import GateSettings

SHARED = {f.name for f in fields(GateSettings)}
# the flat dict every export and Lightning checkpoint wrote before #62 / #63: all keys of every
# kind (the attention recipe's head_dim 32 beside an mlp, as configs/cpt_kvzap.yaml has it)
OLD = {"alpha": 20.0, "beta": 0.45, "gamma": 2.0, "head_dim": 32, "heads": 4, "hidden": 512,
       "kernel": "auto", "kind": "mlp", "mode": "causal", "prefill": "gated",
       "previous_layer": False, "recent": 128, "rope": True, "sinks": 4, "target": "kv",
       "tau": 0.5, "ungated_layers": 0}


def own_fields(kind: str) -> set[str]:
    return {f.name for f in fields(GATES[kind].settings_class)}


def test_the_config_is_the_shared_settings_and_each_registered_kinds_own():
    assert {f.name for f in fields(GateConfig)} == SHARED.union(*map(own_fields, GATE_KINDS))
    assert own_fields("attention") == {"heads", "head_dim", "rope", "mode"}
    assert own_fields("mlp") == {"hidden"} and own_fields("linear") == set()
    for kind in GATE_KINDS:
        settings = GateConfig(kind=kind).kind_settings()
        assert type(settings) is GATES[kind].settings_class and isinstance(settings, KindSettings)
        # the package exports each kind's classes from the registry
        assert getattr(kvgate.gate, GATES[kind].__name__) is GATES[kind]
        assert GATES[kind].__name__ in kvgate.gate.__all__
    assert kvgate.gate.AttentionSettings is GATES["attention"].settings_class


@pytest.mark.parametrize("kind", ["attention", "mlp", "linear"])
def test_a_gate_reads_its_kinds_settings_and_writes_its_flat_form(kind):
    own = {"attention": {"heads": 2, "head_dim": 8, "rope": False}, "mlp": {"hidden": 16},
           "linear": {}}[kind]
    config = GateConfig(kind=kind, gamma=0.0, sinks=1, **own)
    assert set(config.to_dict()) == SHARED | own_fields(kind)
    assert GateConfig.from_dict(config.to_dict()) == config
    model = build(tiny_llama_config())
    patch(model, config)
    gate = gate_modules(model)[0]
    assert gate.settings == config.kind_settings() and gate.config is config


@pytest.mark.parametrize("kind", ["attention", "mlp", "linear"])
def test_the_old_flat_form_loads_as_the_kinds_config(kind):
    old = {**OLD, "kind": kind}
    config = GateConfig.from_dict(old)
    assert config == GateConfig(**{k: v for k, v in old.items() if k in config.to_dict()})
    assert config.to_dict() == {k: v for k, v in old.items() if k in SHARED | own_fields(kind)}
    if kind != "attention":
        assert config.head_dim is None  # the legacy head_dim is ignored, not kept


@pytest.mark.parametrize("kind, extra, field", [
    ("mlp", {"heads": 8}, "heads"), ("linear", {"rope": False}, "rope"),
    ("linear", {"hidden": 16}, "hidden"), ("attention", {"hidden": 256}, "hidden"),
    ("mlp", {"mode": "prompt_bidirectional"}, "mode"),
])
def test_a_value_the_kind_would_not_read_is_one_line_naming_field_and_kind(kind, extra, field):
    for make in (lambda: GateConfig(kind=kind, **extra),
                 lambda: GateConfig.from_dict({**OLD, "kind": kind, **extra})):
        with pytest.raises(ConfigError) as err:
            make()
        line = str(err.value)
        assert line.startswith(f"GateConfig.{field}: kind {kind!r} does not read it")
        assert "\n" not in line


def test_previous_layer_false_loads_and_true_is_refused_naming_the_removed_switch():
    assert GateConfig.from_dict({"previous_layer": False, "sinks": 2}) == GateConfig(sinks=2)
    assert "previous_layer" not in {f.name for f in fields(GateConfig)}
    with pytest.raises(ConfigError) as err:
        GateConfig.from_dict({**OLD, "previous_layer": True})
    line = str(err.value)
    assert line.startswith("GateConfig.previous_layer: gating layer l from layer l-1's input")
    assert "ablation" in line and "no replacement" in line and "\n" not in line


@pytest.fixture
def no_model_load(monkeypatch):
    from kvgate.training.module import KVGateModule

    def refuse(self):
        raise AssertionError("a model was loaded although the config is refused")

    monkeypatch.setattr(KVGateModule, "configure_model", refuse)


def test_a_run_config_with_previous_layer_true_is_one_line_and_false_parses(tmp_path, capsys,
                                                                           no_model_load):
    """``kvgate train``: a config (or flag) saved with ``previous_layer: false`` parses as
    without it; ``true`` stops before any model loads with one line naming the switch."""
    import yaml

    from kvgate.cli.retired import retire_settings
    from kvgate.cli.train import main

    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({"model": {"gate": {"kind": "mlp", "previous_layer": False,
                                                         "heads": 4, "beta": 0.3}}}))
    cleaned = yaml.safe_load(retire_settings(["--config", str(config)])[1])
    assert cleaned == {"model": {"gate": {"kind": "mlp", "heads": 4, "beta": 0.3}}}
    assert retire_settings(["--model.gate.previous_layer", "false"]) == []
    for args in (["--model.gate.previous_layer", "true"],
                 ["--model.gate", json.dumps({"previous_layer": True})]):
        assert main(["--config", "cpt_demo", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: model.gate.previous_layer: gating layer l from layer")
        assert "no replacement" in err and "\n" not in err
    # another kind's field at a value the run's kind would not read: one line naming the flag
    assert main(["--config", "cpt_demo", "--model.gate.kind", "mlp", "--model.gate.heads",
                 "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after any library warning
    assert err.startswith("error: GateConfig.heads: kind 'mlp' does not read it")
    assert err.endswith("(--model.gate.heads)")


@pytest.fixture
def export(tmp_path):
    """A gated mlp export of a tiny base (the folder and its model), gates drawn at random."""
    from kvtrain_fixtures import save_tiny_base

    from kvgate.models import load_base, model_fingerprint

    base_dir = save_tiny_base(tmp_path / "base")
    model, _ = load_base(base_dir)
    torch.manual_seed(0)
    patch(model, GateConfig(kind="mlp", hidden=16, gamma=0.0, alpha=20.0, beta=0.45, sinks=4,
                            recent=128))
    for gate in gate_modules(model):
        torch.nn.init.normal_(gate.down.weight)
    out = export_gated(model, tmp_path / "gated", base_model=base_dir,
                       fingerprint=model_fingerprint(model.config),
                       gate_config=gate_modules(model)[0].config)
    return out, model


def _logits(model):
    ids = torch.randint(4, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def test_an_export_written_in_the_old_flat_form_loads_the_same_gates(export):
    folder, model = export
    meta = json.loads((folder / CONFIG_NAME).read_text())
    assert set(meta["gate"]) == SHARED | {"hidden"}  # the kind's flat form
    loaded, _, _ = load_gated(str(folder))
    want = _logits(model)
    torch.testing.assert_close(_logits(loaded), want, atol=0, rtol=0)
    # the same folder as kvgate wrote it before #62 / #63: every kind's key, previous_layer
    meta["gate"] = {**OLD, "hidden": 16, "gamma": 0.0}
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    old, _, _ = load_gated(str(folder))
    assert gate_modules(old)[0].config == gate_modules(loaded)[0].config
    torch.testing.assert_close(_logits(old), want, atol=0, rtol=0)
    meta["gate"]["previous_layer"] = True
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        load_gated(str(folder))
    assert "GateConfig.previous_layer: gating layer l from layer l-1's input" in str(err.value)
    assert "\n" not in str(err.value)


def test_two_kinds_may_not_give_one_field_two_defaults(monkeypatch):
    """The flat form has one default per field: a kind whose setting clashes with another
    kind's (or a shared one) is a development error at import, naming the kind and field."""
    from dataclasses import dataclass

    from kvgate.gate import config as gate_config
    from kvgate.gate.base import Gate

    @dataclass
    class Wide(KindSettings):
        hidden: int = 1024

    class WideGate(Gate):
        settings_class = Wide

    monkeypatch.setitem(GATES, "wide", WideGate)
    with pytest.raises(TypeError, match="gate kind 'wide': setting 'hidden' clashes"):
        gate_config._owners()
