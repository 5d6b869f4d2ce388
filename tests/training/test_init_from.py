"""KVGateModule(init_from=...): a run that starts from an exported gated checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from kvtrain_fixtures import SyntheticCPT, save_tiny_base

from kvgate.checkpoint import GATES_NAME
from kvgate.gate import GateConfig
from kvgate.training.errors import TrainingConfigError
from kvgate.training.export import export_module
from kvgate.training.module import KVGateModule


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def built(base_dir, **kwargs) -> KVGateModule:
    module = KVGateModule(base_model=base_dir, image_every_n_steps=0, **kwargs)
    module.configure_model()
    return module


def trained_params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.trainable_named_parameters()}


def exported(base_dir, folder, train="gates_lora", seed=1, **kwargs):
    """A module whose trainable weights are random (not the init), exported to ``folder``."""
    module = built(base_dir, train=train, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.trainable_named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    export_module(module, folder)
    return module


def test_gates_and_adapter_start_from_the_export(base_dir, tmp_path):
    source = exported(base_dir, tmp_path / "ck")
    fresh = trained_params(built(base_dir, train="gates_lora"))
    started = built(base_dir, train="gates_lora", init_from=str(tmp_path / "ck"))
    want, got = trained_params(source), trained_params(started)
    assert set(got) == set(want)
    assert any(not torch.equal(fresh[n], want[n]) for n in want)  # the export is not the init
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert started.hparams["init_from"] == str(tmp_path / "ck")


def test_lora_only_and_gates_only_take_their_part(base_dir, tmp_path):
    source = trained_params(exported(base_dir, tmp_path / "both"))
    lora = trained_params(built(base_dir, train="lora", init_from=str(tmp_path / "both")))
    assert lora and all(torch.equal(p, source[n]) for n, p in lora.items())
    gates_src = trained_params(exported(base_dir, tmp_path / "gates", train="gates", seed=2))
    gates = trained_params(built(base_dir, train="gates", init_from=str(tmp_path / "gates")))
    assert all(torch.equal(p, gates_src[n]) for n, p in gates.items())


def test_settings_that_shape_no_weight_come_from_the_run(base_dir, tmp_path):
    exported(base_dir, tmp_path / "ck", train="gates", gate=GateConfig(mode="causal"))
    run_cfg = GateConfig(mode="prompt_bidirectional", tau=0.4, sinks=2, recent=3, beta=0.3)
    module = built(base_dir, train="gates", gate=run_cfg, init_from=str(tmp_path / "ck"))
    assert module.gate_cfg.mode == "prompt_bidirectional" and module.gate_cfg.recent == 3


def test_a_short_run_goes_on_from_the_exported_gates(base_dir, tmp_path):
    exported(base_dir, tmp_path / "ck", train="gates")
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          init_from=str(tmp_path / "ck"))
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
              default_root_dir=tmp_path).fit(
        module, SyntheticCPT(seq_len=16, batch_size=2, val_fraction=0.0))
    # one optimiser step from the exported weights: close to them, not to a fresh init
    start = trained_params(built(base_dir, train="gates", init_from=str(tmp_path / "ck")))
    fresh = trained_params(built(base_dir, train="gates"))
    after = trained_params(module)
    near = sum((after[n] - start[n]).abs().sum() for n in start)
    far = sum((after[n] - fresh[n]).abs().sum() for n in start)
    assert near < 0.1 * far


@pytest.mark.parametrize("train, export_train, match", [
    ("gates", "gates_lora", "train='gates' would drop"),
    ("gates", "lora", "no gates to start from"),
    ("lora", "gates", "no LoRA adapter"),
])
def test_config_time_errors_before_the_base_loads(base_dir, tmp_path, train, export_train, match):
    exported(base_dir, tmp_path / "ck", train=export_train)
    with pytest.raises(TrainingConfigError, match=match):
        KVGateModule(base_model=base_dir, train=train, init_from=str(tmp_path / "ck"))


def test_missing_or_merged_checkpoints_are_refused_by_name(base_dir, tmp_path):
    with pytest.raises(TrainingConfigError, match="init_from: .*no such checkpoint folder"):
        KVGateModule(base_model=base_dir, init_from=str(tmp_path / "nowhere"))
    module = built(base_dir, train="gates_lora")
    export_module(module, tmp_path / "merged", merge=True)
    with pytest.raises(TrainingConfigError, match="merged base"):
        KVGateModule(base_model=base_dir, init_from=str(tmp_path / "merged"))


def test_wrong_base_another_gate_size_or_a_corrupt_file_fail_at_build(base_dir, tmp_path):
    other = save_tiny_base(tmp_path / "other", num_hidden_layers=3)
    exported(other, tmp_path / "other_ck", train="gates")
    with pytest.raises(TrainingConfigError, match="base model mismatch"):
        built(base_dir, train="gates", init_from=str(tmp_path / "other_ck"))

    exported(base_dir, tmp_path / "small", train="gates", gate=GateConfig(heads=1))
    with pytest.raises(TrainingConfigError, match="does not fit layer 0's gate"):
        built(base_dir, train="gates", gate=GateConfig(heads=2), init_from=str(tmp_path / "small"))

    exported(base_dir, tmp_path / "bad", train="gates")
    with open(tmp_path / "bad" / GATES_NAME, "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(TrainingConfigError, match="corrupt"):
        built(base_dir, train="gates", init_from=str(tmp_path / "bad"))


def test_lora_of_another_rank_is_refused(base_dir, tmp_path):
    exported(base_dir, tmp_path / "r4", lora={"rank": 4})
    with pytest.raises(TrainingConfigError, match="adapter does not fit"):
        built(base_dir, train="gates_lora", lora={"rank": 8}, init_from=str(tmp_path / "r4"))
