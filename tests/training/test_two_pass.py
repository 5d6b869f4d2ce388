"""One-shot gates-only training in two passes (kvgate.gate.prefix): the same loss terms and
gate gradients as the whole-block forward, and the whole-block forward wherever two passes
would not be exact."""

from __future__ import annotations

import pytest
import torch
from kvtrain_fixtures import SyntheticCPT, save_tiny_base

from kvgate.gate import GateConfig, gate_modules
from kvgate.gate.prefix import split_point
from kvgate.training.module import KVGateModule


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "llama", num_hidden_layers=3)


def built(base_dir, gate: GateConfig, split: bool, **kwargs) -> KVGateModule:
    torch.manual_seed(0)  # the same gate weights in both modules
    module = KVGateModule(base_model=base_dir, train="gates", gate=gate, image_every_n_steps=0,
                          split_prompt=split, **kwargs)
    module.configure_model()
    return module


def cpt_batch(module, seq_len=24, continuation=8, batch_size=2):
    data = SyntheticCPT(n_docs=40, seq_len=seq_len, batch_size=batch_size, val_fraction=0.0,
                        continuation=continuation)
    data.tokenizer = module.tokenizer
    return next(iter(data.train_dataloader()))


def loss_and_gate_grads(module, batch):
    loss, terms = module.objective(batch)
    params = [p for g in gate_modules(module.model) for p in g.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return loss, terms, grads


@pytest.mark.parametrize("gate", [
    GateConfig(gamma=0.0, beta=0.3, prefill="full", recent=2, sinks=1),
    GateConfig(gamma=0.0, beta=0.3, prefill="full", recent=3, mode="prompt_bidirectional"),
    GateConfig(gamma=0.0, beta=0.3, prefill="full", recent=2, ungated_layers=1),
], ids=["causal_sinks", "bidirectional", "ungated_layer"])
def test_two_passes_give_the_whole_block_loss_and_gate_gradients(base_dir, gate):
    recipe = {"distill_weight": 1.0, "lm_weight": 0.5}
    two, whole = built(base_dir, gate, True, recipe=recipe), built(base_dir, gate, False,
                                                                    recipe=recipe)
    batch = cpt_batch(two)
    assert two.prompt_split(batch) == 16 and whole.prompt_split(batch) is None
    loss2, terms2, grads2 = loss_and_gate_grads(two, batch)
    loss1, terms1, grads1 = loss_and_gate_grads(whole, batch)
    torch.testing.assert_close(loss2, loss1, atol=1e-5, rtol=1e-5)
    for key in ("lm", "distill", "evict"):
        torch.testing.assert_close(terms2[key], terms1[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms2["stats"]["retention_per_head"],
                               terms1["stats"]["retention_per_head"])
    assert terms1["distill"] > 1e-4  # the gates really evict something the teacher reads
    assert 0 < float(terms1["stats"]["retention"].detach()) < 1
    assert sum(float(g.abs().sum()) for g in grads1) > 0
    for g2, g1 in zip(grads2, grads1):
        torch.testing.assert_close(g2, g1, atol=1e-5, rtol=1e-4)
    # nothing of the two passes is left on the gates afterwards
    assert all(g.__dict__.get("prefix") is None for g in gate_modules(two.model))


def test_whole_block_where_two_passes_would_not_be_exact(base_dir):
    one_shot = GateConfig(gamma=0.0, prefill="full", recent=2)
    module = built(base_dir, one_shot, True)
    batch = cpt_batch(module)
    assert module.prompt_split(batch) == 16
    # the paper's in-prefill gate: the prompt's states depend on the gates
    assert built(base_dir, GateConfig(gamma=0.0), True).prompt_split(batch) is None
    # LoRA acts on the prompt too
    lora = KVGateModule(base_model=base_dir, train="gates_lora", gate=one_shot,
                        image_every_n_steps=0)
    lora.configure_model()
    assert lora.prompt_split(batch) is None
    # layers recomputed in backward would not find the stored prompt
    assert built(base_dir, one_shot, True,
                 gradient_checkpointing=True).prompt_split(batch) is None
    # a sliding window shorter than the block
    module.model.config.sliding_window = 8
    assert module.prompt_split(batch) is None
    module.model.config.sliding_window = None


def test_split_point_needs_one_prompt_length_no_padding_and_no_prompt_labels():
    ids = torch.arange(20).view(2, 10)
    prompt = torch.zeros(2, 10, dtype=torch.bool)
    prompt[:, :6] = True
    labels = ids.masked_fill(prompt, -100)
    ones = torch.ones(2, 10, dtype=torch.long)
    assert split_point(ids, ones, prompt, labels) == 6
    assert split_point(ids, None, prompt, labels) == 6
    assert split_point(ids, ones, None, labels) is None
    ragged = prompt.clone()
    ragged[1, 5] = False
    assert split_point(ids, ones, ragged, labels) is None
    padded = ones.clone()
    padded[0, -1] = 0
    assert split_point(ids, padded, prompt, labels) is None
    scored = labels.clone()
    scored[0, 3] = 7
    assert split_point(ids, ones, prompt, scored) is None
    scored[0, 3], scored[0, 0] = -100, 7  # position 0 is never predicted: fine
    assert split_point(ids, ones, prompt, scored) == 6
