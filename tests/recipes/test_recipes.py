"""Small-compute recipes: distillation, retention schedule, warm start, protected tokens."""

import pytest
import torch

import kvgate
from kvgate.gate import GateConfig, gate_modules, last_flags, retention_stats
from kvgate.policies import get_policy
from kvgate.policies.base import Budget
from kvgate.recipes import RetentionSchedule, distillation_loss, heuristic_labels, teacher_logits
from kvgate.recipes.warmstart import warmstart_loss


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


def test_warm_start_moves_gates_toward_heuristic_masks(tiny_llama):
    torch.manual_seed(0)
    kvgate.patch(tiny_llama, GateConfig(gamma=0.0, tau=0.5, beta=0.5))
    for p in tiny_llama.parameters():
        p.requires_grad_(False)
    params = [p for g in gate_modules(tiny_llama) for p in g.parameters()]
    for p in params:
        p.requires_grad_(True)
    x = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    labels = heuristic_labels(tiny_llama, get_policy("h2o"), Budget(ratio=0.5), x)
    assert set(labels) == {0, 1} and labels[0].shape == (4, 2, 32)
    assert labels[0].float().mean().item() == pytest.approx(0.5, abs=0.05)
    opt = torch.optim.Adam(params, lr=1e-2)
    _, before = warmstart_loss(tiny_llama, labels, x)
    for _ in range(60):
        loss, stats = warmstart_loss(tiny_llama, labels, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert stats["balanced_accuracy"] > before["balanced_accuracy"] + 0.1
    assert stats["balanced_accuracy"] > 0.75
