"""KVGateModule: what trains in each regime, the loss, checkpoints without the base, resume."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from kvtrain_fixtures import SyntheticCPT, SyntheticSFT, save_tiny_base
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from kvgate.gate import GateConfig, gate_modules
from kvgate.training.errors import TrainingConfigError
from kvgate.training.module import KVGateModule, causal_lm_loss, lr_factor, sequence_logprob


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama")


def trainer(root, max_steps, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root, callbacks=list(callbacks),
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     limit_val_batches=0, **kwargs)


def built(base_dir, **kwargs) -> KVGateModule:
    module = KVGateModule(base_model=base_dir, image_every_n_steps=0, **kwargs)
    module.configure_model()
    return module


def trainable_names(module):
    return {n for n, _ in module.trainable_named_parameters()}


def test_each_regime_trains_what_it_says(base_dir):
    gates = built(base_dir, train="gates")
    assert trainable_names(gates) and all("kv_gate" in n for n in trainable_names(gates))
    both = built(base_dir, train="gates_lora")
    names = trainable_names(both)
    assert any("kv_gate" in n for n in names) and any(".lora_" in n for n in names)
    assert all("kv_gate" in n or ".lora_" in n for n in names)
    # LoRA never lands on the gate's own projections
    assert not any("kv_gate" in n and ".lora_" in n for n in names)
    lora = built(base_dir, train="lora")
    assert trainable_names(lora) and all(".lora_" in n for n in trainable_names(lora))
    assert gate_modules(lora.model) == []


def test_gates_only_training_keeps_the_base_and_moves_retention_toward_beta(base_dir, tmp_path):
    cfg = GateConfig(gamma=0.0, tau=0.5, beta=0.1, alpha=20.0)
    module = KVGateModule(base_model=base_dir, train="gates", gate=cfg, image_every_n_steps=0,
                          optim={"lr_gate": 0.05, "warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    data = SyntheticCPT(n_docs=40, seq_len=32, batch_size=4, val_fraction=0.0)
    seen = []

    class Track(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(pl_module.last_stats["retention"]))

    module.configure_model()
    base_before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    trainer(tmp_path, max_steps=8, callbacks=[Track()]).fit(module, data)
    assert abs(seen[-1] - cfg.beta) < abs(seen[0] - cfg.beta) - 0.05
    for name, param in module.named_parameters():
        if name in base_before:
            assert torch.equal(param, base_before[name]), name


def test_lm_loss_counts_only_labelled_positions():
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, -100]])
    loss, count = causal_lm_loss(logits, labels)
    expected = torch.nn.functional.cross_entropy(logits[0, 1:3], torch.tensor([3, 4]))
    assert count == 2 and torch.allclose(loss, expected)
    logp = torch.log_softmax(logits[0], -1)
    assert torch.allclose(sequence_logprob(logits, labels), logp[1, 3] + logp[2, 4])


def test_schedule_warms_up_then_decays_to_the_floor():
    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    mid = lr_factor(55, 100, 10, 0.1)
    assert 0.1 < mid < 1.0


def test_checkpoint_holds_only_what_trains(base_dir, tmp_path):
    module = KVGateModule(base_model=base_dir, train="gates_lora", image_every_n_steps=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, max_steps=2, callbacks=[ckpt]).fit(
        module, SyntheticCPT(seq_len=16, batch_size=2, val_fraction=0.0))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    keys = set(saved["state_dict"])
    assert keys == trainable_names(module)
    assert not any("embed_tokens" in k or "mlp" in k or "base_layer" in k for k in keys)
    assert saved["kvgate"]["fingerprint"] == module.fingerprint
    assert saved["optimizer_states"]  # the optimiser state travels with it


class Killed(RuntimeError):
    pass


class Crash(Callback):
    """Simulates a killed run: raises when the given batch is about to start."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            raise Killed(f"killed before step {self.at + 1}")


class Record(Callback):
    def __init__(self) -> None:
        self.steps, self.first_ids = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)
        self.first_ids.append(batch["input_ids"][0, :4].tolist())


def test_killed_run_resumes_at_the_same_step_and_data_position(base_dir, tmp_path):
    def run(root, steps, extra=(), ckpt_path=None):
        torch.manual_seed(0)
        module = KVGateModule(base_model=base_dir, train="gates_lora", image_every_n_steps=0,
                              lora={"dropout": 0.0})
        rec = Record()
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)
        t = trainer(root, max_steps=steps, callbacks=[rec, ckpt, *extra])
        t.fit(module, SyntheticCPT(n_docs=30, seq_len=16, batch_size=2, val_fraction=0.0),
              ckpt_path=ckpt_path)
        return module, rec, t

    full, full_rec, _ = run(tmp_path / "a", 5)
    crashed_rec = Record()
    with pytest.raises(Killed):
        run(tmp_path / "b", 5, extra=[crashed_rec, Crash(at=3)])
    assert crashed_rec.steps == [1, 2, 3]
    resumed, resumed_rec, t = run(tmp_path / "b", 5, ckpt_path="last")
    assert resumed_rec.steps == [4, 5] and t.global_step == 5
    # the resumed run sees exactly the batches the uninterrupted one saw next
    assert crashed_rec.first_ids + resumed_rec.first_ids == full_rec.first_ids
    for (name, a), (_, b) in zip(full.trainable_named_parameters(),
                                 resumed.trainable_named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_sft_run_reports_option_accuracy_and_eviction(base_dir, tmp_path):
    module = KVGateModule(base_model=base_dir, train="gates_lora", image_every_n_steps=0,
                          gate=GateConfig(tau=0.3, gamma=0.0, alpha=1.0, beta=0.28,
                                          mode="prompt_bidirectional"))
    t = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                  num_sanity_val_steps=0)
    t.fit(module, SyntheticSFT(n_train=8, n_val=6, batch_size=4))
    metrics = t.callback_metrics
    assert 0.0 <= float(metrics["val/acc"]) <= 1.0
    assert 0.0 <= float(metrics["val/evict_pct"]) <= 100.0
    assert "train/evict_loss" in metrics


def test_quantized_training_is_refused_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainingConfigError, match="quantize"):
        KVGateModule(quantize="4bit")


@pytest.mark.parametrize("kwargs, key", [
    ({"train": "all"}, "KVGateModule.train"),
    ({"dtype": "int8"}, "KVGateModule.dtype"),
    ({"gate": {"beta": 0.9}}, "GateConfig.beta"),
    ({"lora": {"rank": 0}}, "LoraSettings.rank"),
    ({"optim": {"lr_gate": 0}}, "OptimSettings.lr_gate"),
])
def test_config_errors_name_the_key_before_any_model_loads(kwargs, key):
    with pytest.raises(ValueError, match=key):
        KVGateModule(base_model="/nonexistent/model", **kwargs)


def test_tensorboard_gets_scalars_learning_rates_and_eviction_images(base_dir, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module = KVGateModule(base_model=base_dir, train="gates_lora", image_every_n_steps=2)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    t = L.Trainer(max_steps=3, accelerator="cpu", logger=logger, log_every_n_steps=1,
                  enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path)
    t.fit(module, SyntheticCPT(seq_len=16, batch_size=2, val_fraction=0.0))
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0})
    events.Reload()
    scalars, images = set(events.Tags()["scalars"]), events.Tags()["images"]
    assert {"train/lm_loss", "train/evict_loss", "train/retention", "train/evict_pct",
            "retention_layer/00", "retention_layer/01", "perf/tokens_per_s",
            "lr/gates", "lr/lora"} <= scalars
    assert {"eviction/tokens_x_layers", "eviction/layers_x_heads"} <= set(images)
    # drawn at steps 0 and 2 only
    assert [e.step for e in events.Images("eviction/layers_x_heads")] == [0, 2]


def test_gradient_checkpointing_gives_the_same_gradients(base_dir):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = built(base_dir, train="gates_lora", gradient_checkpointing=checkpointing,
                       lora={"dropout": 0.0})
        ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        lm, _ = causal_lm_loss(module(ids, batch["attention_mask"]), ids)
        ev, _ = module.gate_terms(batch)
        (lm + ev).backward()
        grads.append({n: p.grad.clone() for n, p in module.trainable_named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


def test_gates_of_ungated_layers_are_frozen(base_dir):
    module = built(base_dir, train="gates", gate=GateConfig(ungated_layers=1))
    gates = gate_modules(module.model)
    assert not any(p.requires_grad for p in gates[0].parameters())
    assert all(p.requires_grad for p in gates[1].parameters())


def test_recipe_distillation_with_beta_annealed_from_the_first_step(base_dir, tmp_path):
    from kvgate.recipes.settings import RecipeError, RecipeSettings

    recipe = RecipeSettings(lm_weight=0.0, distill_weight=1.0, beta_start=1.0, beta_steps=4)
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0,
                          gate=GateConfig(gamma=0.0, beta=0.3), recipe=recipe)
    data = SyntheticCPT(n_docs=40, seq_len=32, batch_size=4, val_fraction=0.0)
    logged = []

    class Track(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append((trainer.global_step, set(trainer.callback_metrics),
                           pl_module.current_beta()))

    trainer(tmp_path, max_steps=5, callbacks=[Track()]).fit(module, data)
    assert all("train/distill_kl" in metrics and "train/beta" in metrics
               for _, metrics, _ in logged)
    betas = {step: beta for step, _, beta in logged}
    assert betas[1] == pytest.approx(1.0 - 0.7 * 0.25)  # 1 step into the 4-step anneal
    assert betas[4] == pytest.approx(0.3) and betas[5] == pytest.approx(0.3)
    with pytest.raises(RecipeError, match="distill_teacher"):
        RecipeSettings(distill_teacher="frozen")


def test_sft_on_every_choice_distils_each_choice_but_teaches_only_the_gold_one(base_dir):
    from kvgate.recipes.settings import RecipeSettings
    from kvgate.training.data import collate_sft

    module = built(base_dir, train="gates", gate=GateConfig(gamma=0.0, beta=0.3),
                   recipe=RecipeSettings(lm_weight=1.0, distill_weight=1.0, beta_start=None))
    data = SyntheticSFT(n_train=4, max_len=64, answers="all")
    rows = list(data.build_train(module.tokenizer))
    every_choice = collate_sft(rows, pad_id=0)
    as_gold = collate_sft([(ids, plen) for ids, plen, _ in rows], pad_id=0)  # all labelled
    gold_only = collate_sft([(ids, plen) for ids, plen, gold in rows if gold], pad_id=0)
    with torch.no_grad():
        _, terms = module.objective(every_choice)
        _, terms_as_gold = module.objective(as_gold)
        _, terms_gold_only = module.objective(gold_only)
    # the KL reads every choice's tokens, exactly as if each were labelled ...
    assert terms["distill"] > 0
    assert torch.allclose(terms["distill"], terms_as_gold["distill"], atol=1e-6)
    # ... while the LM loss is the gold rows' alone
    assert torch.allclose(terms["lm"], terms_gold_only["lm"], atol=1e-5)
    assert not torch.allclose(terms["lm"], terms_as_gold["lm"], atol=1e-3)


@pytest.mark.parametrize("teacher", ["adapted", "base"])
def test_lora_distils_towards_the_adapted_model_or_the_frozen_base(base_dir, teacher):
    from kvgate.recipes import teacher_logits
    from kvgate.recipes.settings import RecipeSettings
    from kvgate.training.data import collate_sft
    from kvgate.training.lora import LoraSettings

    # gates held open: the student is the base plus its adapter, so only the teacher differs
    module = built(base_dir, train="gates_lora", gate=GateConfig(gamma=50.0),
                   lora=LoraSettings(dropout=0.5),
                   recipe=RecipeSettings(lm_weight=0.0, distill_weight=1.0,
                                         distill_teacher=teacher))
    with torch.no_grad():  # a trained adapter: B is zero at init, so make it move the output
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn_like(p))
    batch = collate_sft(list(SyntheticSFT(n_train=4, max_len=64).build_train(module.tokenizer)),
                        pad_id=0)
    # the teacher is a fixed target: no dropout noise, and every module keeps its mode
    module.train()
    frozen = module.model.get_output_embeddings().eval()
    ids = batch["input_ids"]
    assert torch.equal(teacher_logits(module.model, adapters=teacher == "adapted", input_ids=ids),
                       teacher_logits(module.model, adapters=teacher == "adapted", input_ids=ids))
    assert module.model.training and not frozen.training
    module.eval()  # the student without dropout too, so gates-open student == adapted teacher
    _, terms = module.objective(batch)
    if teacher == "adapted":  # the target moves with the adapter: nothing to learn
        assert terms["distill"].abs().item() < 1e-5
    else:  # the frozen base is a fixed target the adapter is pulled back to
        assert terms["distill"].item() > 1e-3
        terms["distill"].backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0
                   for n, p in module.model.named_parameters() if "lora_" in n)


def test_every_choice_without_distillation_fails_before_the_base_loads(base_dir, tmp_path):
    from kvgate.recipes.settings import RecipeSettings

    # without the KL the wrong choices' rows teach nothing: a clear error, not silent waste
    for kwargs in ({"train": "gates", "recipe": RecipeSettings(distill_weight=0.0)},
                   {"train": "lora"}):
        module = KVGateModule(base_model=base_dir, image_every_n_steps=0, **kwargs)
        with pytest.raises(TrainingConfigError, match="data.answers"):
            trainer(tmp_path, max_steps=1).fit(module, SyntheticSFT(n_train=4, answers="all"))
        assert module.model is None


def test_prompt_continuation_cpt_gates_only_the_prompt_and_scores_only_the_continuation(base_dir):
    """CPT with ``continuation``: a prompt_bidirectional gate flags the prompt (the continuation
    is never evicted or counted), and the loss ignores every prompt position."""
    module = built(base_dir, train="gates",
                   gate=GateConfig(gamma=0.0, beta=0.3, mode="prompt_bidirectional"))
    data = SyntheticCPT(n_docs=40, seq_len=24, batch_size=2, val_fraction=0.0, continuation=8)
    data.tokenizer = module.tokenizer
    batch = next(iter(data.train_dataloader()))
    module(batch["input_ids"], batch["attention_mask"], batch["prompt_mask"])
    from kvgate.gate.loss import gate_records

    records = gate_records(module.model)
    assert records
    for _, rec in records:
        assert torch.equal(rec.counted, batch["prompt_mask"])
        assert (rec.gate[..., 16:] == 1).all()  # continuation tokens are always kept
    assert any((rec.gate[..., :16] == 0).any() for _, rec in records)  # the prompt is gated
    # position t predicts token t+1: the logits of prompt positions 0..14 never reach the loss,
    # position 15 (the prompt's last token) predicts the first continuation token and does
    logits = torch.randn(2, 24, module.model.config.vocab_size)
    loss, _ = causal_lm_loss(logits, batch["labels"])
    prompt_changed, last_changed = logits.clone(), logits.clone()
    prompt_changed[:, :15] += torch.randn_like(prompt_changed[:, :15])
    last_changed[:, 15] += torch.randn_like(last_changed[:, 15])
    assert torch.equal(causal_lm_loss(prompt_changed, batch["labels"])[0], loss)
    assert not torch.isclose(causal_lm_loss(last_changed, batch["labels"])[0], loss)


def test_full_prefill_cpt_encodes_the_prompt_as_the_base_and_gates_only_what_follows(base_dir, tmp_path):
    """``prefill="full"``: prompt positions get exactly the gates-open model's logits (the
    prompt attends fully), the continuation reads the gated prompt (its logits move), the last
    ``recent`` prompt tokens are kept and counted, the gates get a gradient, and a run without
    a prompt / continuation split is refused by name."""
    from kvgate.gate.loss import gate_records
    from kvgate.recipes import teacher_logits

    module = built(base_dir, train="gates",
                   gate=GateConfig(gamma=0.0, beta=0.3, prefill="full", recent=2))
    data = SyntheticCPT(n_docs=40, seq_len=24, batch_size=2, val_fraction=0.0, continuation=8)
    data.tokenizer = module.tokenizer
    batch = next(iter(data.train_dataloader()))
    logits = module(batch["input_ids"], batch["attention_mask"], batch["prompt_mask"])
    records = gate_records(module.model)
    teacher = teacher_logits(module.model, input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"], use_cache=False)
    torch.testing.assert_close(logits[:, :16], teacher[:, :16], atol=1e-5, rtol=1e-4)
    assert (logits[:, 16:] - teacher[:, 16:]).abs().max() > 1e-3
    for _, rec in records:
        assert torch.equal(rec.counted, batch["prompt_mask"])
        assert (rec.gate[..., 14:] == 1).all()  # the last 2 prompt tokens and the continuation
    assert any((rec.gate[..., :14] == 0).any() for _, rec in records)
    loss, _ = causal_lm_loss(logits, batch["labels"])
    gates = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, gates, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)

    plain = SyntheticCPT(n_docs=40, seq_len=24, batch_size=2, val_fraction=0.0)
    plain.tokenizer = module.tokenizer
    with pytest.raises(TrainingConfigError, match="prefill.*continuation"):
        module.training_step(next(iter(plain.train_dataloader())), 0)


def test_loaders_before_the_model_is_built_read_only_the_tokenizer(base_dir, tmp_path):
    """Lightning's DeepSpeed strategy asks for the training loader before configure_model (to
    size its batches): the data must tokenise with the base's tokenizer, the model stay unbuilt."""
    module = KVGateModule(base_model=base_dir, train="gates", image_every_n_steps=0)
    data = SyntheticCPT(n_docs=20, seq_len=16, batch_size=2, val_fraction=0.0)
    t = trainer(tmp_path, max_steps=1)
    t.strategy.connect(module)  # attach as fit does, without its configure_model
    data.trainer = t
    module.trainer = t
    batch = next(iter(data.train_dataloader()))
    assert module.model is None and batch["input_ids"].shape == (2, 16)
    reference = SyntheticCPT(n_docs=20, seq_len=16, batch_size=2, val_fraction=0.0)
    read_first = module.tokenizer
    module.configure_model()
    assert module.tokenizer is read_first  # the one the data used, not a second copy
    reference.tokenizer = module.tokenizer
    torch.testing.assert_close(data.train_dataset()[0], reference.train_dataset()[0])
