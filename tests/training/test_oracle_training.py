"""Training on oracle labels: ``kvgate data oracle`` then ``kvgate train`` on one config, the
batch carrying the labels, the oracle loss logged beside the others, and one-line refusals."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import yaml
from conftest import build, tiny_llama_config
from kvtrain_fixtures import SyntheticCPT, char_tokenizer, save_tiny_base, tiny_config
from lightning.pytorch.callbacks import Callback

from kvgate.cli import main as kvgate_main
from kvgate.data.oracle import LabelStore, OracleError, base_fingerprint
from kvgate.data.oracle.compute import label_data
from kvgate.training.errors import TrainingConfigError
from kvgate.training.module import KVGateModule

ORACLE = {"chunk": 16, "shard_blocks": 16}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def oracle_data(path, **kwargs) -> SyntheticCPT:
    return SyntheticCPT(n_docs=4, seq_len=24, batch_size=2, val_fraction=0.0,
                        oracle={"path": str(path), **ORACLE}, **kwargs)


def fit(module, data, root, steps=3, callbacks=()):
    L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              limit_val_batches=0, default_root_dir=root,
              callbacks=list(callbacks)).fit(module, data)


class Seen(Callback):
    """The training batches' keys and the logged oracle terms."""

    def __init__(self) -> None:
        self.keys, self.oracle, self.agreement, self.batches = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.keys.append(set(batch))
        self.batches.append((batch["input_ids"].clone(), batch.get("oracle")))
        self.oracle.append(float(trainer.callback_metrics["train/oracle_loss"]))
        self.agreement.append(float(trainer.callback_metrics["train/oracle_agreement"]))


@pytest.mark.parametrize("kind", ["mse_log", "bce", "rank"])
def test_the_batch_carries_labels_and_the_oracle_loss_is_logged(base_dir, tmp_path, kind):
    model, tok = build(tiny_llama_config()), char_tokenizer()
    label_data(model, tok, oracle_data(tmp_path / "labels"), base_dir, lambda line: None)
    module = KVGateModule(base_model=base_dir, train="gates_lora", image_every_n_steps=0,
                          gate={"gamma": 0.0, "beta": 0.4, "sinks": 2},
                          recipe={"distill_weight": 1.0, "oracle_weight": 0.5, "oracle_loss": kind})
    seen, data = Seen(), oracle_data(tmp_path / "labels")
    fit(module, data, tmp_path, callbacks=[seen])
    assert all("oracle" in keys for keys in seen.keys)
    assert all(math.isfinite(v) and v >= 0 for v in seen.oracle) and len(seen.oracle) == 3
    assert module.oracle_fingerprint == base_fingerprint(model)
    # the sampler shuffles the blocks: each row's labels are still its own block's
    blocks, labels = data.train_blocks(), LabelStore(data.oracle.path).read()
    for ids, oracle in seen.batches:
        for row, row_labels in zip(ids, oracle):
            index = int((blocks == row).all(-1).nonzero()[0, 0])
            assert torch.equal(row_labels, labels[index])


def test_one_shot_gates_learn_the_labels_of_the_prompt(base_dir, tmp_path):
    """``prefill: full`` on prompt + continuation blocks (the two-pass training): labels cover
    the prompt, which is all the gate decides on."""
    data = oracle_data(tmp_path / "labels", continuation=8)
    label_data(build(tiny_llama_config()), char_tokenizer(), data, base_dir, lambda line: None)
    assert LabelStore(data.oracle.path).read().shape[-1] == data.label_context() == 16
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          gate={"prefill": "full", "gamma": 0.0, "beta": 0.4},
                          recipe={"distill_weight": 1.0, "oracle_weight": 1.0})
    seen = Seen()
    fit(module, oracle_data(tmp_path / "labels", continuation=8), tmp_path, steps=2,
        callbacks=[seen])
    assert len(seen.oracle) == 2 and all(math.isfinite(v) for v in seen.oracle)


def test_labels_of_another_base_are_refused_by_the_run(base_dir, tmp_path):
    other = build(tiny_llama_config())
    with torch.no_grad():
        other.lm_head.weight.add_(0.01)
    label_data(other, char_tokenizer(), oracle_data(tmp_path / "labels"), "other",
               lambda line: None)
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          recipe={"oracle_weight": 1.0})
    with pytest.raises(OracleError, match="another base") as err:
        fit(module, oracle_data(tmp_path / "labels"), tmp_path)
    assert "\n" not in str(err.value)


def test_labels_are_read_only_when_the_oracle_trains(base_dir, tmp_path):
    """Without oracle_weight the labels folder is never read (it need not even exist)."""
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0)
    fit(module, oracle_data(tmp_path / "absent"), tmp_path, steps=1)
    assert module.oracle_fingerprint is None


@pytest.mark.parametrize("kwargs, match", [
    ({"train": "lora", "recipe": {"oracle_weight": 1.0}}, "train 'lora' has none"),
    ({"train": "gates", "gate": {"target": "query"}, "recipe": {"oracle_weight": 1.0}},
     "set model.gate.target: kv"),
])
def test_oracle_settings_the_model_cannot_use_are_one_line_errors(base_dir, kwargs, match):
    with pytest.raises(TrainingConfigError, match=match) as err:
        KVGateModule(base_model=base_dir, image_every_n_steps=0, **kwargs)
    assert "\n" not in str(err.value)


def test_an_oracle_run_without_labels_is_refused_before_the_model_loads(base_dir, tmp_path,
                                                                         monkeypatch):
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          recipe={"oracle_weight": 1.0})
    monkeypatch.setattr(KVGateModule, "configure_model", lambda self: pytest.fail("loaded"))
    data = SyntheticCPT(n_docs=4, seq_len=24, batch_size=2, val_fraction=0.0)
    with pytest.raises(TrainingConfigError, match="set data.init_args.oracle"):
        fit(module, data, tmp_path)


def test_labels_then_training_from_one_config(base_dir, tmp_path, capsys):
    """The two commands of a recipe's header: ``kvgate data oracle --config`` (run twice: the
    second finds everything done), then ``kvgate train --config``."""
    import train

    config = tiny_config(tmp_path, base_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["train"] = "gates"
    cfg["model"]["recipe"] = {"lm_weight": 0.0, "oracle_weight": 1.0, "oracle_loss": "bce"}
    cfg["data"]["init_args"] |= {"n_docs": 4, "seq_len": 24,
                                 "oracle": {"path": str(tmp_path / "labels"), **ORACLE}}
    config.write_text(yaml.safe_dump(cfg))
    assert kvgate_main(["data", "oracle", "--config", str(config)]) == 0
    assert "done:" in capsys.readouterr().out
    assert kvgate_main(["data", "oracle", "--config", str(config)]) == 0
    assert train.main(["--config", str(config)]) == 0
    assert (tmp_path / "run" / "gated" / "kvgate_config.json").is_file()


def test_the_oracle_command_names_what_is_missing(base_dir, tmp_path, capsys):
    config = tiny_config(tmp_path, base_dir)  # no data.init_args.oracle
    assert kvgate_main(["data", "oracle", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.init_args.oracle: not set") and "\n" not in err


@pytest.mark.parametrize("override, key", [
    (["--model.recipe.oracle_loss", "kl"], "RecipeSettings.oracle_loss"),
    (["--model.recipe.oracle_weight", "-1"], "RecipeSettings.oracle_weight"),
    (["--model.recipe.oracle_keep", "0"], "RecipeSettings.oracle_keep"),
    (["--data.oracle.chunk", "0"], "OracleLabels.chunk"),
    (["--data.oracle.sinks", "-2"], "OracleLabels.sinks"),
])
def test_bad_oracle_values_in_the_recipe_are_one_line_before_loading(override, key, capsys,
                                                                     monkeypatch):
    import train

    monkeypatch.setattr(KVGateModule, "configure_model", lambda self: pytest.fail("loaded"))
    assert train.main(["--config", "cpt_oracle", *override]) == 2
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1


def _gates_only_step(module, batch, graph: bool):
    """One objective + backward of ``module`` on ``batch``, the gates-only path on or off;
    returns the loss, the gates' gradients and whether a base MLP ran with autograd."""
    grad_seen = []
    mlp = module.model.model.layers[0].mlp
    handle = mlp.register_forward_hook(lambda *_: grad_seen.append(torch.is_grad_enabled()))
    module.gates_only_step = lambda: graph  # the switch alone, everything else the same
    try:
        loss, _ = module.objective(batch)
    finally:
        handle.remove()
        del module.gates_only_step
    params = [p for n, p in module.model.named_parameters() if "kv_gate" in n]
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads, grad_seen[0]


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_a_gates_only_step_runs_the_model_without_autograd_and_trains_the_gates(
        base_dir, tmp_path, kind):
    """lm_weight 0 and no distillation (KVzap's recipe): the step's forward runs without
    autograd outside the gates; its loss equals the full-graph step's, and with the eviction
    loss off (alpha 0) so do the gates' gradients (the oracle loss reads each gate's own
    inputs either way)."""
    data = oracle_data(tmp_path / "labels")
    label_data(build(tiny_llama_config()), char_tokenizer(), data, base_dir, lambda line: None)
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          gate={"kind": kind, "gamma": 0.0, "beta": 0.4, "alpha": 0.0,
                                "sinks": 2},
                          recipe={"lm_weight": 0.0, "oracle_weight": 1.0})
    module.configure_model()
    assert module.gates_only_step()  # what this recipe selects
    data.oracle_base = module.oracle_fingerprint  # what the Trainer's fit hands the data
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    full_loss, full_grads, full_autograd = _gates_only_step(module, batch, graph=False)
    loss, grads, autograd = _gates_only_step(module, batch, graph=True)
    assert full_autograd and not autograd
    torch.testing.assert_close(loss, full_loss)
    assert any(g.abs().sum() > 0 for g in grads)
    for got, want in zip(grads, full_grads):
        torch.testing.assert_close(got, want)
    # with the LM loss or the distillation on, the step keeps the full graph
    for recipe in ({"lm_weight": 1.0, "oracle_weight": 1.0},
                   {"lm_weight": 0.0, "distill_weight": 1.0, "oracle_weight": 1.0}):
        other = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                             recipe=recipe)
        assert not other.gates_only_step()


def test_damaged_labels_are_named_recomputed_by_the_oracle_and_refused_by_training(
        base_dir, tmp_path, capsys):
    """#64 cases 2 and 4: a shard overwritten with NaN (a valid file, other bytes) and a
    truncated shard are caught by their recorded sha256 / size: training refuses with the
    exact command, which then computes those two shards again, naming them."""
    from safetensors.torch import load_file, save_file

    import train

    config = tiny_config(tmp_path, base_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["train"] = "gates"
    cfg["model"]["recipe"] = {"lm_weight": 0.0, "oracle_weight": 1.0}
    cfg["data"]["init_args"] |= {"n_docs": 6, "seq_len": 24,
                                 "oracle": {"path": str(tmp_path / "labels"), "chunk": 16,
                                            "shard_blocks": 2}}
    config.write_text(yaml.safe_dump(cfg))
    assert kvgate_main(["data", "oracle", "--config", str(config)]) == 0
    store = LabelStore(tmp_path / "labels")
    whole = store.read().clone()
    assert len(store.manifest()["shards"]) >= 2
    first, second = (store.path / s["file"] for s in store.manifest()["shards"][:2])
    labels = load_file(first)["log_scores"]
    save_file({"log_scores": torch.full_like(labels, float("nan"))}, first)
    second.write_bytes(second.read_bytes()[:100])
    capsys.readouterr()

    assert train.main(["--config", str(config)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1
    err = errors[0]
    assert err.startswith("error: ") and "sha256" in err and first.name in err
    assert f"run kvgate data oracle --config {config}" in err
    assert not (tmp_path / "run" / "gated").exists()

    assert kvgate_main(["data", "oracle", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"{first}" in out and "sha256 differs" in out and "computing it again" in out
    assert f"{second}" in out and "bytes" in out
    assert torch.equal(store.read(), whole)


def test_non_finite_labels_are_never_written(base_dir, tmp_path, monkeypatch):
    from kvgate.data.oracle import compute

    monkeypatch.setattr(compute, "block_scores",
                        lambda *a, **k: torch.full((1, 2, 2, 24), float("nan")))
    model, tok = build(tiny_llama_config()), char_tokenizer()
    with pytest.raises(OracleError, match=r"^block 0: the base's KVzip scores are not finite"):
        label_data(model, tok, oracle_data(tmp_path / "labels"), base_dir, lambda line: None)
    assert not list((tmp_path / "labels").glob("shard-*"))


def test_a_folder_of_the_first_format_is_adopted_without_recomputing(base_dir, tmp_path,
                                                                     monkeypatch):
    """Labels written before sizes and hashes were recorded are checked (whole, finite) and
    kept: no block is labelled again, and the manifest then records them."""
    import json

    from kvgate.data.oracle import compute

    model, tok = build(tiny_llama_config()), char_tokenizer()
    data = oracle_data(tmp_path / "labels")
    data.oracle.shard_blocks = 1
    label_data(model, tok, data, base_dir, lambda line: None)
    store = LabelStore(tmp_path / "labels")
    meta = store.manifest()
    old = {**meta, "version": 1, "shards": [{k: s[k] for k in ("file", "start", "stop")}
                                            for s in meta["shards"]]}
    del old["shard_blocks"]
    store.manifest_path.write_text(json.dumps(old))
    monkeypatch.setattr(compute, "block_scores", lambda *a, **k: pytest.fail("relabelled"))
    lines = []
    label_data(model, tok, data, base_dir, lines.append)
    assert any(f"adopted {len(meta['shards'])} shard(s)" in line for line in lines)
    assert store.manifest()["shards"] == meta["shards"] and store.manifest()["version"] == 2
