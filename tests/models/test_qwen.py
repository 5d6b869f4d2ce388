"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm before RoPE) next to LLaMA and Mistral:
support check and fingerprint, open gates equal the base, the compressed cache under every
policy, a training step, and a gated export that reloads with equal logits."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from conftest import (
    build_causal_lm,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_config,
    tiny_qwen3_config,
)
from training.kvtrain_fixtures import SyntheticCPT, char_tokenizer

import kvgate
from kvgate.cache import CompressedCache
from kvgate.checkpoint import load_gated
from kvgate.gate import GateConfig, gate_modules, gates_open
from kvgate.models import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitectureError,
    architecture_fields,
    check_supported,
    load_base,
    model_fingerprint,
)
from kvgate.policies import PassScoring, get_policy, list_policies, policy_class
from kvgate.policies.base import Budget
from kvgate.training.export import export_module
from kvgate.training.module import KVGateModule

CONFIGS = {"qwen2": tiny_qwen2_config, "qwen3": tiny_qwen3_config}
LEARNED = {n for n in list_policies() if policy_class(n).needs_gate}  # gated: the export test
SMALL = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4},
         "adakv": {"inner_options": {"window": 4}}, "ahakv": {"recent": 4},
         "h2o": {"recent": 0.5}, "roco": {"block": 4}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def qwen(request):
    return build_causal_lm(CONFIGS[request.param]())


def _batch(b=2, n=16, pad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (b, n), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :4] = 0
    return ids, mask


def test_qwen_families_pass_the_check_and_have_their_own_fingerprints():
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(SUPPORTED_MODEL_TYPES)
    for make in CONFIGS.values():
        check_supported(make())
    # LLaMA / Mistral fingerprints are what they were before Qwen support (old checkpoints load)
    assert model_fingerprint(tiny_llama_config()) == "68b7343dbc903b9d"
    assert model_fingerprint(tiny_mistral_config()) == "cdabc96e9bc6c04e"
    assert "qk_norm" not in architecture_fields(tiny_llama_config())
    q2, q3 = architecture_fields(tiny_qwen2_config()), architecture_fields(tiny_qwen3_config())
    assert q2["attention_bias"] is True and q2["qk_norm"] is False
    assert q3["attention_bias"] is False and q3["qk_norm"] is True
    fps = {model_fingerprint(c) for c in (
        tiny_llama_config(), tiny_qwen2_config(head_dim=16), tiny_qwen3_config(),
        tiny_qwen3_config(attention_bias=True), tiny_qwen3_config(num_key_value_heads=4))}
    assert len(fps) == 5
    # settings that shape nothing leave it alone
    assert model_fingerprint(tiny_qwen3_config(rms_norm_eps=1e-5)) == \
        model_fingerprint(tiny_qwen3_config())


@pytest.mark.parametrize("config", [
    pytest.param(lambda: tiny_qwen2_config(use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1), id="qwen2-mixed-window"),
    pytest.param(lambda: __import__("transformers").Gemma2Config(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=128), id="gemma2"),
])
def test_sliding_global_mixes_are_refused_in_one_line(config):
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_supported(config())
    message = str(info.value)
    assert "\n" not in message and "qwen3" in message and "mix" in message


def test_uniform_sliding_window_qwen2_is_supported():
    check_supported(tiny_qwen2_config(use_sliding_window=True, sliding_window=8,
                                      max_window_layers=0))


def test_saved_qwen3_folder_loads_through_load_base(tmp_path):
    build_causal_lm(tiny_qwen3_config()).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_base(str(tmp_path))
    assert model.config.model_type == "qwen3" and tokenizer.pad_token is not None


@pytest.mark.parametrize("pad", [False, True])
def test_open_gates_reproduce_the_base_logits(qwen, pad):
    model = copy.deepcopy(qwen)
    ids, mask = _batch(pad=pad)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        kvgate.patch(model, GateConfig(gamma=50.0))  # sigmoid(s + 50) > tau: all kept
        out = model(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=0)
        with gates_open(model):
            torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], ref[real],
                                       atol=1e-5, rtol=0)
        kvgate.patch(model, GateConfig(gamma=0.0))  # gates that evict: the route is live
        assert (model(ids, attention_mask=mask).logits - ref)[real].abs().max() > 1e-3
        kvgate.unpatch(model)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref)


def test_snapkv_at_half_keeps_half_and_full_equals_the_base(qwen):
    ids, mask = _batch(pad=False)
    with torch.no_grad():
        ref = qwen(ids, attention_mask=mask).logits
        full = CompressedCache(qwen, get_policy("full"), Budget(ratio=1.0))
        out = qwen(ids, attention_mask=mask, past_key_values=full, use_cache=True).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        cache = CompressedCache(qwen, get_policy("snapkv", window=4), Budget(ratio=0.5))
        qwen(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.kept_fraction() == 0.5
    for layer in range(qwen.config.num_hidden_layers):
        assert (cache.kept_counts(layer) == ids.shape[1] // 2).all()
    assert cache.bytes_held() < 0.6 * cache.full_bytes()


# a PassScoring policy (kvzip) needs its extra passes, which model.generate does not run:
# tests/policies/test_kvzip.py runs it through the engine on a tiny Qwen3
@pytest.mark.parametrize("name", [n for n in list_policies() if n not in LEARNED
                                  and not issubclass(policy_class(n), PassScoring)])
def test_every_policy_runs_through_the_cache(qwen, name):
    ids, mask = _batch(n=20)
    cache = CompressedCache(qwen, get_policy(name, **SMALL.get(name, {})), Budget(ratio=0.5))
    gen = qwen.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3,
                        min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (2, 23)
    if name != "full":
        assert cache.kept_fraction() < 0.85


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3") / "base"
    build_causal_lm(tiny_qwen3_config()).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def test_qwen3_trains_exports_and_reloads_with_equal_logits(qwen3_base, tmp_path):
    module = KVGateModule(base_model=qwen3_base, train="gates", image_every_n_steps=0,
                          gate=GateConfig(gamma=0.0, tau=0.5, beta=0.3),
                          optim={"lr_gate": 0.05, "warmup_ratio": 0.0, "min_lr_ratio": 1.0})
    module.configure_model()
    before = [p.detach().clone() for g in gate_modules(module.model) for p in g.parameters()]
    data = SyntheticCPT(n_docs=12, seq_len=32, batch_size=4, val_fraction=0.0)
    L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              limit_val_batches=0, default_root_dir=tmp_path).fit(module, data)
    after = [p.detach() for g in gate_modules(module.model) for p in g.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "no gate moved"
    out = export_module(module, tmp_path / "gated")
    model, tokenizer, meta = load_gated(out)
    assert model.config.model_type == "qwen3" and tokenizer is not None
    assert meta["base"]["fingerprint"] == model_fingerprint(model.config)
    ids, mask = _batch(n=24)
    with torch.no_grad():
        want = module.model.eval()(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    # the learned gate as a policy over the compressed cache of the reloaded model
    cache = CompressedCache(model, get_policy("attention_gate"), Budget(ratio=0.5))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert 0.0 < cache.kept_fraction() <= 1.0
