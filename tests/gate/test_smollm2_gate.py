"""The gate core on the real embedded model (SmolLM2-135M, LLaMA architecture, GQA 9/3)."""

import pytest
import torch

import kvgate
from kvgate.gate import GateConfig, eviction_loss, gate_modules


@pytest.fixture(scope="module")
def smollm2():
    from kvgate.models import load_base

    return load_base("smollm2-135m", dtype=torch.float32)


@pytest.mark.slow
def test_smollm2_open_gates_match_and_evicting_gates_train(smollm2):
    model, tok = smollm2
    enc = tok(["The quick brown fox jumps over the lazy dog near the river bank.",
               "Paris is the capital of France."], return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**enc).logits
        kvgate.patch(model, GateConfig(gamma=50.0))
        try:
            out = model(**enc).logits
            real = enc["attention_mask"].bool()
            torch.testing.assert_close(out[real], ref[real], atol=1e-4, rtol=0)
            assert len(gate_modules(model)) == model.config.num_hidden_layers
            assert gate_modules(model)[0].o_proj.out_features == model.config.num_key_value_heads
        finally:
            kvgate.unpatch(model)
    kvgate.patch(model, GateConfig(gamma=0.0))
    try:
        out = model(**enc, labels=enc["input_ids"])
        ev, stats = eviction_loss(model)
        (out.loss + ev).backward()
        grads = [p.grad for g in gate_modules(model) for p in g.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert 0.0 < stats["retention"].item() < 1.0
    finally:
        kvgate.unpatch(model)
        model.zero_grad(set_to_none=True)
