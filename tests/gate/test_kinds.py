"""Gate kinds (attention, mlp, linear) on tiny random LLaMAs: wide open they are the base,
bad kinds are one-line errors, the local kinds' policy holds the cache at threshold + window
while decoding, and its prefill is what feeding the prompt token by token gives."""

from __future__ import annotations

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config

import kvgate
from kvgate.cache import CompressedCache
from kvgate.gate import (
    GATE_KINDS,
    GATES,
    ConfigError,
    GateConfig,
    gate_class,
    gate_modules,
    gates_open,
    retention_stats,
)
from kvgate.models import dispatch
from kvgate.policies import Budget, PolicyError, RowScoring, get_policy

LOCAL = ["mlp", "linear"]


def _inputs(b=2, n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (b, n), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_the_registry_names_every_kind_the_config_accepts():
    assert tuple(GATES) == GATE_KINDS == ("attention", "mlp", "linear")
    assert all(gate_class(k).kind == k for k in GATES)
    assert [k for k in GATES if gate_class(k).local] == LOCAL
    assert GateConfig().kind == "attention"  # the default stays the paper's gate


@pytest.mark.parametrize("bad, key", [({"kind": "conv"}, "kind"), ({"kind": None}, "kind"),
                                      ({"kind": "mlp", "hidden": 0}, "hidden"),
                                      ({"hidden": True}, "hidden"),
                                      ({"kind": "linear", "mode": "prompt_bidirectional"}, "mode")])
def test_bad_kind_settings_are_one_line_errors_naming_the_key(bad, key):
    for make in (lambda: GateConfig(**bad), lambda: GateConfig.from_dict(bad)):
        with pytest.raises(ConfigError) as err:
            make()
        assert str(err.value).startswith(f"GateConfig.{key}: ") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^GateConfig.kind: must be one of attention, mlp, "):
        gate_class("conv")


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_wide_open_gates_give_the_base_logits(kind):
    """A fresh local gate keeps everything (zero output layer: sigmoid(gamma) > tau), so the
    patched model starts as the base; the attention kind does with a large gamma; every kind
    with its gates forced open."""
    model = build(tiny_llama_config())
    ids, mask, pos = _inputs()
    real = mask.bool()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
        kvgate.patch(model, GateConfig(kind=kind) if kind in LOCAL else GateConfig(gamma=50.0))
        assert all(type(g) is gate_class(kind) for g in gate_modules(model))
        got = model(ids, attention_mask=mask, position_ids=pos).logits
        assert retention_stats(model)["retention"].item() == 1.0
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
        if kind in LOCAL:
            patch_evicting(model, kind)
        else:
            kvgate.patch(model, GateConfig(gamma=0.0))
        model(ids, attention_mask=mask, position_ids=pos)
        assert retention_stats(model)["retention"].item() < 1.0
        with gates_open(model):
            opened = model(ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(opened[real], ref[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", LOCAL)
def test_local_kinds_score_each_token_alone(kind):
    """A local gate's score of a token does not move when the tokens before it change."""
    model = build(tiny_llama_config())
    patch_evicting(model, kind)
    gate = gate_modules(model)[0]
    hidden = torch.randn(1, 6, 64)
    other = hidden.clone()
    other[:, :5] = torch.randn(1, 5, 64)
    assert gate.scores(hidden).shape == (1, 2, 6)  # [B, H_kv, n]
    torch.testing.assert_close(gate.scores(hidden)[..., 5], gate.scores(other)[..., 5])


def _held(cache: CompressedCache, layer: int, length: int) -> torch.Tensor:
    """[B, H_kv, length] bool: the real positions a layer of the cache holds."""
    store = cache.layers[layer].store
    pos, valid = store.slot_positions(), store.slot_valid()
    width = max(length, int(pos.max()) + 1)  # the last column collects the empty slots
    held = torch.zeros(*pos.shape[:2], width + 1, dtype=torch.bool)
    return held.scatter_(-1, torch.where(valid, pos, width), True)[..., :length]


def _above(model, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, m] bool: sigmoid(score + gamma) > tau of the layer's gate, by hand."""
    gate = gate_modules(model)[layer]
    return torch.sigmoid(gate.scores(hidden) + gate.config.gamma) > gate.config.tau


@pytest.mark.parametrize("kind", LOCAL)
@pytest.mark.parametrize("prefill,interval", [("gated", 1), ("full", 1), ("gated", 4)])
def test_local_gate_decoding_holds_the_cache_at_threshold_plus_window(kind, prefill, interval):
    """During a decode of several steps every KV head holds exactly the tokens whose keep
    probability is above tau plus the last ``window`` tokens, generated tokens included (each
    scored from its own hidden state, recorded here as the forward ran); with rounds every
    ``interval`` steps, the window as of the last round."""
    model = build(tiny_llama_config())
    patch_evicting(model, kind)
    window, steps = 3, 6
    ids, mask, pos = _inputs(n=12)
    real = mask.bool()
    cache = CompressedCache(model, get_policy("local_gate", window=window, prefill=prefill,
                                              interval=interval), Budget(ratio=1.0))
    seen: dict[int, list[torch.Tensor]] = {}  # each layer's gate input, per forward

    def tap(module, query, key, value, attn_mask, scaling, call):
        seen.setdefault(module.layer_idx, []).append(call.hidden)

    evicted = 0
    with torch.no_grad(), dispatch.tapped(model, tap):
        out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        for step in range(steps + 1):
            for layer in range(2):
                for b in range(2):
                    prompt, *decoded = seen[layer]
                    hidden = torch.cat([prompt[b, real[b]], *(h[b] for h in decoded)])[None]
                    length = hidden.shape[1]
                    # the rows written since the last round wait, and so does its window
                    recent = torch.arange(length) >= length - window - step % interval
                    want = _above(model, layer, hidden)[0] | recent  # [H_kv, length]
                    assert torch.equal(_held(cache, layer, length)[b], want), (step, layer, b)
                    assert torch.equal(cache.kept_counts(layer)[b], want.sum(-1))
                    evicted += int((~want).sum())
            if step == steps:
                break
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache)
    assert evicted > 0  # the gates do evict


@pytest.mark.parametrize("kind", LOCAL)
@pytest.mark.parametrize("extra", [{}, {"target": "query"}, {"ungated_layers": 1}])
def test_local_gate_prefill_equals_feeding_the_prompt_token_by_token(kind, extra):
    """With the gated prefill (eq. 5 with a band of window + 1) each prompt row sees what a
    decoding row at its place sees, so prefilling equals feeding one token at a time; and it
    equals the training forward of a gate with recent = window + 1. Also for per-query-head
    gates and ungated layers."""
    model = build(tiny_llama_config())
    window = 3
    patch_evicting(model, kind, recent=window + 1, **extra)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(3))

    def cache():  # a round after every token (interval 1), as a prompt row sees it
        return CompressedCache(model, get_policy("local_gate", window=window, interval=1),
                               Budget(ratio=1.0))

    with torch.no_grad():
        trained = model(ids).logits
        whole = cache()
        at_once = model(ids, past_key_values=whole).logits
        single = cache()
        steps = [model(ids[:, i:i + 1], past_key_values=single).logits for i in range(12)]
    if "target" not in extra:  # per-query-head flags: the cache keeps what any of a group keeps
        torch.testing.assert_close(at_once, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, 1), at_once, atol=1e-5, rtol=0)
    for layer in range(2):
        assert torch.equal(_held(whole, layer, 12), _held(single, layer, 12))
    assert whole.kept_fraction() < 0.9


def test_local_gate_policy_needs_a_local_gate_and_checks_its_options():
    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig())
    ids, mask, pos = _inputs()
    with pytest.raises(PolicyError, match="local gate .* kind 'attention': use attention_gate"):
        model(ids, attention_mask=mask, position_ids=pos,
              past_key_values=CompressedCache(model, get_policy("local_gate"), 1.0))
    assert isinstance(get_policy("local_gate"), RowScoring)
    assert get_policy("local_gate").window == 128  # KVzap's window
    for bad in ({"window": -1}, {"tau": 1.5}, {"prefill": "eager"}):
        with pytest.raises(PolicyError, match=f"local_gate.{next(iter(bad))}"):
            get_policy("local_gate", **bad)


@pytest.mark.parametrize("kind", LOCAL)
def test_attention_gate_policy_runs_a_local_gate_and_keeps_generated_tokens(kind):
    """The one-shot policy serves every kind: it thresholds the prompt and keeps every
    generated token (held entries only grow while decoding)."""
    model = build(tiny_llama_config())
    patch_evicting(model, kind)
    ids, mask, _ = _inputs()
    cache = CompressedCache(model, get_policy("attention_gate"), 1.0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=0, past_key_values=cache)
    assert out.shape == (2, 18) and cache.kept_fraction() < 0.9
    assert not cache.layers[0].stats  # nothing scored while decoding
    for layer in range(2):
        held = _held(cache, layer, 17)
        assert held[0, :, 10:13].all() and held[1, :, 14:17].all()  # the 3 tokens fed back


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_under_autocast_a_gate_reads_a_half_precision_input_without_an_upcast_copy(kind,
                                                                                   monkeypatch):
    """bf16-mixed (the GPU recipes): the fp32 gate's scores from a bf16 input equal those from
    the input upcast first (autocast runs the matmuls in bf16 either way), and no fp32 copy of
    the input is made; outside autocast the input is upcast to the weights' fp32."""
    from kvgate.gate import base

    model = build(tiny_llama_config())
    kvgate.patch(model, GateConfig(kind=kind, **({"hidden": 16} if kind == "mlp" else {})))
    gate = gate_modules(model)[0]
    hidden = torch.randn(2, 9, 64).bfloat16()
    assert base.in_gate_dtype(hidden, torch.zeros(1)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate.scores(hidden)
        assert base.in_gate_dtype(hidden, torch.zeros(1)) is hidden
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False)  # the old upcast
        want = gate.scores(hidden)
    assert got.dtype == torch.float32 and torch.equal(got, want)
