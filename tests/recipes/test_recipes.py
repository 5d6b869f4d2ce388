"""Small-compute recipes: distillation, retention schedule, protected tokens, the settings."""

import pytest
import torch

import kvgate
from kvgate.gate import GateConfig, gate_modules, last_flags, retention_stats
from kvgate.recipes import RetentionSchedule, distillation_loss, teacher_logits
from kvgate.recipes.settings import RETIRED, RecipeError, RecipeSettings


def test_kl_is_zero_when_gates_all_open(tiny_llama):
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    kvgate.patch(tiny_llama, GateConfig(gamma=50.0))
    student = tiny_llama(x).logits
    teacher = teacher_logits(tiny_llama, input_ids=x)
    assert distillation_loss(student, teacher).abs().item() < 1e-6
    kvgate.patch(tiny_llama, GateConfig(gamma=0.0))
    evicting = tiny_llama(x).logits
    kl = distillation_loss(evicting, teacher)
    assert kl.item() > 1e-4
    kl.backward()  # reaches the gates through the straight-through flags
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for g in gate_modules(tiny_llama) for p in g.parameters())


def test_kl_mask_selects_positions():
    s = torch.randn(1, 4, 10)
    t = s.clone()
    t[0, 3] += torch.randn(10)
    mask = torch.tensor([[True, True, True, False]])
    assert distillation_loss(s, t, mask).item() == pytest.approx(0.0, abs=1e-7)
    assert distillation_loss(s, t).item() > 0


@pytest.mark.parametrize("kind,mid", [("linear", 0.7), ("cosine", 0.7)])
def test_retention_schedule_values(kind, mid):
    sch = RetentionSchedule(start=1.0, end=0.4, steps=100, kind=kind)
    assert sch(0) == pytest.approx(1.0)
    assert sch(50) == pytest.approx(mid)
    assert sch(100) == pytest.approx(0.4)
    assert sch(1000) == pytest.approx(0.4)
    if kind == "linear":
        assert sch(25) == pytest.approx(0.85)
    else:
        assert sch(25) == pytest.approx(1.0 - 0.6 * 0.5 * (1 - 2 ** -0.5))
    assert RetentionSchedule(end=0.3, steps=0)(0) == 0.3
    with pytest.raises(ValueError, match="kind"):
        RetentionSchedule(kind="step")


def test_protected_tokens_never_evicted(tiny_mistral):
    kvgate.patch(tiny_mistral, GateConfig(gamma=0.0, tau=0.999, beta=0.0, sinks=3, recent=4))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 16, dtype=torch.long)
    am[1, :5] = 0
    tiny_mistral(x, attention_mask=am)
    for flags in last_flags(tiny_mistral):
        assert (flags[0, :, :3] == 1).all() and (flags[1, :, 5:8] == 1).all()
        assert (flags[0, :, 3:] == 0).all()  # everything else evicted at tau 0.999
    # evicted or not, each query still sees its last 4 keys: compare with a pure local mask
    from kvgate.attention.gated import gated_attention

    q = torch.randn(1, 2, 10, 8)
    k = torch.randn(1, 1, 10, 8)
    v = torch.randn(1, 1, 10, 8)
    out = gated_attention(q, k, v, torch.zeros(1, 1, 10), recent=4)
    local = torch.ones(10, 10, dtype=torch.bool).tril() & ~torch.ones(10, 10, dtype=torch.bool).tril(-4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 2, 10, 8),
                                                           v.expand(1, 2, 10, 8), attn_mask=local)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert retention_stats(tiny_mistral)["retention"].item() > 0


def test_a_checkpoint_trained_with_a_removed_setting_still_loads_its_recipe():
    """A run's hyper-parameters keep every recipe key it had; the warm start's are dropped
    (the run is over: its record loads), any other unknown key is refused naming it."""
    saved = {"lm_weight": 0.0, "distill_weight": 1.0, "warmstart_steps": 30,
             "warmstart_policy": "h2o", "warmstart_keep": 0.45}
    assert set(RETIRED) == {"warmstart_steps", "warmstart_policy", "warmstart_keep"}
    assert RecipeSettings.from_dict(saved) == RecipeSettings(lm_weight=0.0, distill_weight=1.0)
    assert not hasattr(RecipeSettings(), "warmstart_steps")
    with pytest.raises(RecipeError, match=r"unknown key\(s\) \['warm_start'\]"):
        RecipeSettings.from_dict({"warm_start": 3})
