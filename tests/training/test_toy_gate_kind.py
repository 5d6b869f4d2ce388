"""A gate kind added as docs/ARCHITECTURE.md says, from this file alone (a ``Gate`` subclass with
its settings dataclass, and one line in ``kvgate.gate.kinds.GATES``): ``kvgate train`` builds
and trains it a step, the export records its kind (and the shared settings alone: it has no
field of another kind) and loads back as it, and ``kvgate infer`` serves it.

Registered here after the package loaded, the kind's own fields take their defaults: they join
the run config's flat form (``--model.gate.init_bias``) through the line in kinds.py, whose
kinds ``GateConfig``'s fields are built from."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import pytest
import torch
import yaml
from kvtrain_fixtures import save_tiny_base, tiny_config
from torch import Tensor, nn

from kvgate.checkpoint import CONFIG_NAME, load_gated
from kvgate.cli import main as kvgate_main
from kvgate.gate import GATES, GateConfig, KindSettings, gate_modules
from kvgate.gate.base import Gate, in_gate_dtype
from kvgate.gate.settings import GateSettings


@dataclass
class BiasSettings(KindSettings):
    """The toy's own setting: the bias every head starts with."""

    init_bias: float = 0.0

    def validate(self) -> None:
        if self.init_bias < 0:
            raise self._bad("init_bias", "must be >= 0 (a negative bias starts evicting)")


class BiasGate(Gate):
    """Each token scored from its own hidden state: one linear map to every gated head plus a
    learned bias per head (a toy; the point is what it takes to add a kind)."""

    kind = "bias"
    local = True
    settings_class = BiasSettings

    def __init__(self, hidden_size: int, out_heads: int, config, head_dim: int | None = None):
        super().__init__(config, out_heads)
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        self.bias = nn.Parameter(torch.full((out_heads,), self.settings.init_bias))
        nn.init.zeros_(self.proj.weight)  # wide open at the start, as the shipped kinds

    def scores(self, hidden: Tensor, position_embeddings=None,
               attend: Tensor | None = None) -> Tensor:
        one = self.proj(in_gate_dtype(hidden, self.proj.weight)).float().transpose(1, 2)
        return one + self.bias.float()[None, :, None]


@pytest.fixture
def bias_kind(monkeypatch):
    monkeypatch.setitem(GATES, "bias", BiasGate)  # the registry line


def test_a_kind_added_from_one_file_trains_exports_and_infers(bias_kind, tmp_path, capsys):
    base = save_tiny_base(tmp_path / "llama")
    config = tiny_config(tmp_path, base, max_steps=1)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"].update(train="gates", gate={"kind": "bias", "beta": 0.3},
                        optim={"lr_gate": 0.05, "warmup_ratio": 0.0})
    cfg["model"].pop("lora")
    config.write_text(yaml.safe_dump(cfg))
    assert kvgate_main(["train", "--config", str(config)]) == 0, capsys.readouterr().err

    gated = tmp_path / "run" / "gated"
    stored = json.loads((gated / CONFIG_NAME).read_text())["gate"]
    assert stored["kind"] == "bias" and GateConfig.from_dict(stored).kind == "bias"
    assert set(stored) == {f.name for f in fields(GateSettings)}  # no other kind's field
    model, _, _ = load_gated(str(gated))
    gates = gate_modules(model)
    assert gates and all(type(g) is BiasGate for g in gates)
    assert gates[0].settings == BiasSettings()
    assert any(float(g.bias.abs().sum()) > 0 for g in gates)  # the step moved the new tensor

    capsys.readouterr()
    code = kvgate_main(["infer", "--checkpoint", str(gated), "--prompt", "the cat sat on",
                        "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["stats"]["policy"].startswith("local_gate") and len(data["token_ids"][0]) == 3
