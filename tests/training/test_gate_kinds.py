"""Each gate kind through the whole product: a short gates-only run trains only the gates;
the export records the kind, loads back with equal logits and is served by its policy."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from kvtrain_fixtures import SyntheticCPT, save_tiny_base

from kvgate.cache import CompressedCache
from kvgate.checkpoint import CONFIG_NAME, gate_kind, load_gated
from kvgate.gate import GATE_KINDS, gate_class, gate_modules
from kvgate.policies import get_policy
from kvgate.policies.registry import gate_policy_name
from kvgate.training.errors import TrainingConfigError
from kvgate.training.export import export_module
from kvgate.training.module import KVGateModule


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def module_of(base_dir, kind: str, **kwargs) -> KVGateModule:
    gate = {"kind": kind, "beta": 0.3, "alpha": 20.0, **({"hidden": 16} if kind == "mlp" else {})}
    module = KVGateModule(base_model=base_dir, train="gates", gate=gate, image_every_n_steps=0,
                          optim={"lr_gate": 0.05, "warmup_ratio": 0.0, "min_lr_ratio": 1.0},
                          **kwargs)
    module.configure_model()
    return module


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_a_short_run_trains_every_gate_tensor_and_nothing_else(base_dir, tmp_path, kind):
    module = module_of(base_dir, kind)
    assert all(type(g) is gate_class(kind) for g in gate_modules(module.model))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".kv_gate." in n for n in trainable)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, SyntheticCPT(n_docs=16, seq_len=16, batch_size=2, val_fraction=0.0))
    for name, param in module.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (name in trainable), name  # every gate tensor learns, the base does not


def _randomise_gates(module: KVGateModule) -> None:
    """Gate weights as after training: large enough that some entries are evicted."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if ".kv_gate." in name:
                p.normal_(0.0, 0.5)


def _logits(model) -> torch.Tensor:
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _generate(model) -> tuple[list[list[int]], float]:
    ids = torch.randint(4, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    name = gate_policy_name(gate_modules(model)[0].kind)
    policy = get_policy(name, **({"window": 4} if name == "local_gate" else {}))
    cache = CompressedCache(model, policy, 1.0)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         pad_token_id=0, past_key_values=cache)
    return out[:, 24:].tolist(), cache.kept_fraction()


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_exported_then_loaded_gives_equal_logits_and_is_served_by_its_policy(base_dir, tmp_path,
                                                                             kind):
    module = module_of(base_dir, kind).eval()
    _randomise_gates(module)
    out = export_module(module, tmp_path / "gated")
    model, _, meta = load_gated(out)
    assert meta["gate"]["kind"] == kind == gate_kind(out)
    assert all(type(g) is gate_class(kind) for g in gate_modules(model))
    assert torch.equal(_logits(model), _logits(module.model))
    assert gate_policy_name(kind) == ("attention_gate" if kind == "attention" else "local_gate")
    tokens, kept = _generate(model)
    assert tokens == _generate(module.model)[0] and kept < 0.95


def test_an_export_from_before_gate_kinds_loads_as_the_attention_gate(base_dir, tmp_path):
    module = module_of(base_dir, "attention").eval()
    out = export_module(module, tmp_path / "gated")
    config = out / CONFIG_NAME
    meta = json.loads(config.read_text())
    del meta["gate"]["kind"]  # and no hidden: the attention kind writes none
    assert "hidden" not in meta["gate"]
    config.write_text(json.dumps(meta))
    assert gate_kind(out) == "attention"
    model, _, _ = load_gated(out)
    assert torch.equal(_logits(model), _logits(module.model))


def test_init_from_another_kind_is_one_line(base_dir, tmp_path):
    out = export_module(module_of(base_dir, "mlp"), tmp_path / "gated")
    with pytest.raises(TrainingConfigError, match="holds gates of kind 'mlp', this run trains "
                                                  "kind 'linear'; set gate.kind: mlp"):
        module_of(base_dir, "linear", init_from=str(out))
