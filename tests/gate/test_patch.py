"""Gates installed into tiny LLaMA / Mistral: equivalence when open, causality, training signal."""

import copy

import pytest
import torch

import kvgate
from kvgate.gate import (
    ConfigError,
    GateConfig,
    UnsupportedModelError,
    eviction_loss,
    gate_modules,
    gate_records,
    gates_open,
    last_flags,
    prompt_segment,
    retention_stats,
)


def _inputs(pad: bool, b=2, n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 128, (b, n), generator=g)
    am = torch.ones(b, n, dtype=torch.long)
    if pad:
        am[0, :4] = 0
    return x, am


@pytest.mark.parametrize("pad", [False, True])
def test_gates_forced_open_equal_unpatched_logits(tiny_model, pad):
    x, am = _inputs(pad)
    ref = tiny_model(x, attention_mask=am).logits
    base_state = copy.deepcopy(tiny_model.state_dict())
    kvgate.patch(tiny_model, GateConfig(gamma=50.0))  # sigmoid(s + 50) > tau: all kept
    out = tiny_model(x, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=0)
    assert retention_stats(tiny_model)["retention"].item() == 1.0
    with gates_open(tiny_model):
        torch.testing.assert_close(tiny_model(x, attention_mask=am).logits[real], ref[real],
                                   atol=1e-5, rtol=0)
    # base parameters untouched; gate parameters carry "gate" in their names
    for name, p in tiny_model.state_dict().items():
        if "kv_gate" not in name:
            assert torch.equal(p, base_state[name]), name
    assert any("self_attn.kv_gate" in n for n, _ in tiny_model.named_parameters())
    kvgate.unpatch(tiny_model)
    assert not gate_modules(tiny_model)
    torch.testing.assert_close(tiny_model(x, attention_mask=am).logits, ref)


def test_eviction_changes_logits_and_loss_is_alpha_abs_gap(tiny_llama):
    x, am = _inputs(True)
    ref = tiny_llama(x, attention_mask=am).logits
    cfg = GateConfig(gamma=0.0, alpha=2.0, beta=0.3)
    kvgate.patch(tiny_llama, cfg)
    out = tiny_llama(x, attention_mask=am).logits
    loss, stats = eviction_loss(tiny_llama)
    r = stats["retention"]
    assert 0.0 < r.item() < 1.0
    assert loss.item() == pytest.approx(2.0 * abs(r.item() - 0.3), rel=1e-5)
    assert stats["retention_per_head"].shape == (2, 2)  # layers x KV heads
    # %Evict is the sample mean of per-sample ratios (paper), retention the token mean
    flags = torch.stack([f for f in last_flags(tiny_llama)])  # [L, B, H, n]
    real = am.bool()
    per_sample = [(flags[:, b][..., real[b]]).mean().item() for b in range(2)]
    expected = 100 * (1 - sum(per_sample) / 2)
    assert stats["evict_pct"].item() == pytest.approx(expected, abs=1e-3)
    assert (out - ref)[am.bool()].abs().max() > 1e-3


def test_padding_does_not_count_in_retention(tiny_llama):
    x, am = _inputs(True)
    kvgate.patch(tiny_llama, GateConfig(gamma=0.0))
    tiny_llama(x, attention_mask=am)
    gate = gate_records(tiny_llama)[0][1]
    assert gate.counted.sum().item() == am.sum().item()
    # flags at padding are forced to 1 and excluded from the mean
    assert (gate.gate[0, :, :4] == 1).all()


def test_causal_gate_changing_next_token_leaves_the_past_unchanged(tiny_model):
    kvgate.patch(tiny_model, GateConfig(gamma=0.0))
    x, _ = _inputs(False, b=1, n=16)
    j = 8
    x2 = x.clone()
    x2[0, j + 1] = (x[0, j + 1] + 7) % 128
    out1 = tiny_model(x).logits
    flags1 = [f.clone() for f in last_flags(tiny_model)]
    out2 = tiny_model(x2).logits
    flags2 = [f for f in last_flags(tiny_model)]
    torch.testing.assert_close(out1[:, : j + 1], out2[:, : j + 1], atol=1e-6, rtol=0)
    for f1, f2 in zip(flags1, flags2):
        assert torch.equal(f1[..., : j + 1], f2[..., : j + 1])


def test_prompt_bidirectional_answer_tokens_cannot_change_prompt_flags(tiny_llama):
    kvgate.patch(tiny_llama, GateConfig(gamma=0.0, tau=0.5, beta=0.3, mode="prompt_bidirectional"))
    x, _ = _inputs(False, b=1, n=16)
    prompt = torch.zeros(1, 16, dtype=torch.bool)
    prompt[0, :10] = True
    x2 = x.clone()
    x2[0, 12] = (x[0, 12] + 5) % 128  # an answer token
    with prompt_segment(tiny_llama, prompt):
        out1 = tiny_llama(x).logits
        f1 = [f.clone() for f in last_flags(tiny_llama)]
        out2 = tiny_llama(x2).logits
        f2 = [f for f in last_flags(tiny_llama)]
    torch.testing.assert_close(out1[:, :12], out2[:, :12], atol=1e-6, rtol=0)
    for a, b in zip(f1, f2):
        assert torch.equal(a[..., :10], b[..., :10])
        assert (a[..., 10:] == 1).all()  # tokens after the prompt are never gated
    # bidirectional over the prompt: a later prompt token moves the first layer's gate
    # scores at earlier prompt positions (flags are thresholded, so compare raw scores)
    gate0 = gate_modules(tiny_llama)[0]
    emb = tiny_llama.model.embed_tokens
    norm = tiny_llama.model.layers[0].input_layernorm
    from kvgate.gate.apply import gate_attend_mask

    attend = gate_attend_mask(torch.ones(1, 16, dtype=torch.bool), prompt, "prompt_bidirectional")
    x3 = x.clone()
    x3[0, 9] = (x[0, 9] + 3) % 128
    s1 = gate0.scores(norm(emb(x)), None, attend)
    s3 = gate0.scores(norm(emb(x3)), None, attend)
    assert (s1[..., :9] - s3[..., :9]).abs().max() > 1e-6


def test_sinks_never_evicted_and_ungated_layers(tiny_llama):
    x, am = _inputs(True)
    kvgate.patch(tiny_llama, GateConfig(gamma=0.0, tau=0.9, beta=0.0, sinks=2, ungated_layers=1))
    tiny_llama(x, attention_mask=am)
    g0, g1 = [f for f in last_flags(tiny_llama)]
    assert (g0 == 1).all()  # first layer ungated
    assert (g1[1, :, :2] == 1).all()  # sample 1: first two tokens
    assert (g1[0, :, 4:6] == 1).all()  # sample 0 is left padded by 4
    assert (g1 == 0).any()


def test_per_query_head_target(tiny_mistral):
    kvgate.patch(tiny_mistral, GateConfig(gamma=0.0, target="query"))
    tiny_mistral(_inputs(False)[0])
    assert last_flags(tiny_mistral)[0].shape == (2, 4, 14)


def test_patch_works_under_peft(tiny_llama):
    peft = pytest.importorskip("peft")
    x, am = _inputs(True)
    ref = tiny_llama(x, attention_mask=am).logits
    lora = peft.get_peft_model(tiny_llama, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    kvgate.patch(lora, GateConfig(gamma=50.0))
    out = lora(x, attention_mask=am).logits
    torch.testing.assert_close(out[am.bool()], ref[am.bool()], atol=1e-5, rtol=0)
    assert len(gate_modules(lora)) == 2


def test_unsupported_architecture_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="not supported for gating"):
        kvgate.patch(model)


def test_rotary_gate_wider_than_the_models_rotary_tables_is_refused_at_patch(tiny_llama):
    # tiny head_dim is 16: a 32-wide rotary gate would fail only in the first forward pass
    with pytest.raises(ConfigError, match="GateConfig.head_dim: 32 exceeds this model's rotary "
                                          "dimension 16"):
        kvgate.patch(tiny_llama, GateConfig(head_dim=32))
    kvgate.patch(tiny_llama, GateConfig(head_dim=32, rope=False))  # no positions: any width
    ids = torch.randint(0, 100, (1, 8))
    assert tiny_llama(ids).logits.shape == (1, 8, tiny_llama.config.vocab_size)


@pytest.mark.parametrize("key,value", [("tau", 1.5), ("beta", 0.6), ("heads", 0), ("gamma", -1.0),
                                        ("mode", "bidirectional"), ("sinks", -1),
                                        ("prefill", "eager")])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"GateConfig.{key}"):
        GateConfig(**{key: value})
    with pytest.raises(ConfigError, match="unknown"):
        GateConfig.from_dict({"tua": 0.5})


def test_training_gates_only_moves_retention_toward_beta(tiny_llama):
    torch.manual_seed(0)
    cfg = GateConfig(gamma=2.0, alpha=5.0, beta=0.4, tau=0.5)
    kvgate.patch(tiny_llama, cfg)
    for p in tiny_llama.parameters():
        p.requires_grad_(False)
    gate_params = [p for g in gate_modules(tiny_llama) for p in g.parameters()]
    for p in gate_params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(gate_params, lr=3e-3)
    x = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    tiny_llama(x)
    start = retention_stats(tiny_llama)["retention"].item()
    for _ in range(200):
        out = tiny_llama(x, labels=x)
        ev, stats = eviction_loss(tiny_llama, cfg)
        (out.loss + ev).backward()
        opt.step()
        opt.zero_grad()
    end = stats["retention"].item()
    assert start > 0.9
    assert abs(end - cfg.beta) < abs(start - cfg.beta) - 0.3


def test_an_unpadded_gated_forward_reads_nothing_back_from_the_device(tiny_llama):
    """With no attention mask every token is real: the gated layers decide that without
    reading a tensor back (on a GPU each read is a device sync that drains the launch queue);
    a padded batch reads its mask once per forward, not once per gated layer (the first layer
    derives the gate's mask and the others share it)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_local_scalar_dense") and any(
                    "kvgate/gate" in f.filename for f in traceback.extract_stack()):
                self.count += 1
            return func(*args, **(kwargs or {}))

    kvgate.patch(tiny_llama, GateConfig(kernel="chunked"))
    x, am = _inputs(pad=True)
    with Reads() as unpadded:
        tiny_llama(x).logits.sum().backward()
    assert unpadded.count == 0
    with Reads() as padded:
        tiny_llama(x, attention_mask=am)
    assert len(gate_modules(tiny_llama)) == 2 and padded.count == 1
