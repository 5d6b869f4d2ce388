"""The oracle objective (kvgate.recipes.oracle): each loss decreases on a toy run, its gradient
reaches the gates alone, KVzip's keep labels are one ranking over layers and heads, and the
training module carries it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build, tiny_llama_config

import kvgate
from kvgate.gate import GateConfig, gate_modules, gate_records, recorded_scores
from kvgate.recipes.oracle import ORACLE_LOSSES, keep_cut, oracle_inputs, oracle_loss
from kvgate.recipes.settings import RecipeError, RecipeSettings
from kvgate.training.build import prepare_for_training
from kvgate.training.lora import LoraSettings, lora_parameters

N = 20


def toy_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, N] and log-score labels [2, L, H_kv, N] that depend on the tokens (a gate
    reading the hidden states can learn them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (2, N), generator=gen)
    table = torch.randn(2, 2, 128, generator=gen) * 3.0 - 5.0  # [L, H_kv, vocab]
    return ids, table[:, :, ids].permute(2, 0, 1, 3).contiguous()


@pytest.mark.parametrize("kind", list(ORACLE_LOSSES))
def test_each_oracle_loss_decreases_on_a_toy_run(kind):
    torch.manual_seed(0)
    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig(sinks=2, beta=0.5))
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for g in gate_modules(model) for p in g.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=0.02)
    ids, labels = toy_batch()
    losses, agreement = [], []
    for _ in range(40):
        with recorded_scores(model):
            model(ids)
        loss, info = oracle_loss(model, labels, kind, keep=0.5, gamma=2.0, tau=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        agreement.append(info["agreement"].item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (kind, losses)
    assert agreement[-1] > agreement[0] and agreement[-1] > 0.7


def test_the_oracle_gradient_reaches_the_gates_alone():
    torch.manual_seed(0)
    model = prepare_for_training(build(tiny_llama_config()), quantized=False,
                                 gradient_checkpointing=False,
                                 lora=LoraSettings(rank=4, dropout=0.0),
                                 gate=GateConfig(gamma=0.0, beta=0.5), init_from=None)
    ids, labels = toy_batch()
    gates = [p for g in gate_modules(model) for p in g.parameters()]
    lora = list(lora_parameters(model))
    assert lora and gates
    with recorded_scores(model):
        logits = model(input_ids=ids).logits
    loss, _ = oracle_loss(model, labels, "mse_log", keep=0.5, gamma=0.0, tau=0.5)
    loss.backward(retain_graph=True)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates[-4:])  # last layer
    assert all(p.grad is None or not p.grad.any() for p in lora)
    assert all(p.grad is None for n, p in model.named_parameters()
               if "kv_gate" not in n and ".lora_" not in n)
    # the same forward's other losses do reach LoRA (through the flags and hidden states)
    logits.float().logsumexp(-1).mean().backward()
    assert any(p.grad is not None and p.grad.any() for p in lora)


def test_each_layer_gate_learns_from_its_own_layer_only():
    """A whole-block forward: layer 1's input depends on layer 0's gate (its flags shape the
    attention), yet layer 1's oracle term gives layer 0's gate nothing."""
    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig(gamma=0.0))
    for p in model.parameters():
        p.requires_grad_(False)
    for g in gate_modules(model):
        g.requires_grad_(True)
    ids, labels = toy_batch()
    with recorded_scores(model):
        model(ids)
    s, _, _ = oracle_inputs(model, labels)
    s[:, 1].sum().backward()
    first, second = gate_modules(model)
    assert all(p.grad is None or not p.grad.any() for p in first.parameters())
    assert all(p.grad is not None and p.grad.any() for p in second.parameters())


def test_scores_are_recorded_only_when_asked():
    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig())
    ids, _ = toy_batch()
    model(ids)
    assert all(r.scores is None for _, r in gate_records(model))
    with recorded_scores(model):
        model(ids)
    assert all(r.scores is not None for _, r in gate_records(model))
    model(ids)
    assert all(r.scores is None for _, r in gate_records(model))


def test_keep_labels_are_one_ranking_over_layers_and_heads():
    gen = torch.Generator().manual_seed(0)
    targets = torch.randn(3, 2, 2, 10, generator=gen)  # [B, G, H, m]
    decided = torch.ones_like(targets, dtype=torch.bool)
    decided[:, :, :, :2] = False  # sinks
    decided[2] = False  # a block with nothing to decide
    cut = keep_cut(targets, decided, 0.25)
    kept = (targets >= cut[:, None, None, None]) & decided
    assert kept[0].sum() == kept[1].sum() == round(0.25 * 2 * 2 * 8)
    assert not kept[2].any() and math.isinf(cut[2])
    for b in range(2):  # the kept entries are the highest decided ones, wherever they are
        chosen = targets[b][kept[b]]
        assert chosen.min() >= targets[b][decided[b] & ~kept[b]].max()
    # heads do not keep equal shares (a global ranking, not one per head)
    per_head = kept[:2].sum(-1)
    assert (per_head != per_head.flatten()[0]).any()


def test_mse_targets_put_the_gates_threshold_at_kvzips_cut():
    """A gate scoring exactly the shifted targets has zero MSE and agrees with every label but
    the cut itself (its score sits on the threshold, which a flag must exceed)."""
    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig(gamma=2.0, tau=0.5, sinks=2))
    ids, labels = toy_batch()
    with recorded_scores(model):
        model(ids)
    _, targets, decided = oracle_inputs(model, labels)
    cut = keep_cut(targets, decided, 0.5)
    threshold = math.log(0.5 / 0.5) - 2.0
    shifted = targets - cut[:, None, None, None] + threshold
    for g, (_, r) in enumerate(gate_records(model)):
        r.scores = shifted[:, g] + 0.0
    loss, info = oracle_loss(model, labels, "mse_log", keep=0.5, gamma=2.0, tau=0.5)
    one_per_block = 2 / decided.sum().item()
    assert loss.item() < 1e-10
    assert info["agreement"].item() == pytest.approx(1.0 - one_per_block)


@pytest.mark.parametrize("bad, match", [
    ({"oracle_weight": -0.5}, "oracle_weight: must be a number >= 0"),
    ({"oracle_weight": "x"}, "oracle_weight"),
    ({"oracle_loss": "kl"}, "oracle_loss: must be one of mse_log | bce | rank"),
    ({"oracle_keep": 1.5}, r"oracle_keep: must lie in \(0, 1\]"),
    ({"lm_weight": 0.0}, "cannot all be 0"),
])
def test_bad_recipe_values_are_one_line_errors(bad, match):
    with pytest.raises(RecipeError, match=match) as err:
        RecipeSettings(**bad)
    assert "\n" not in str(err.value)
    RecipeSettings(lm_weight=0.0, oracle_weight=1.0)  # the oracle alone is a loss
