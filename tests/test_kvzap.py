"""KVzap's checkpoint format (#66): NVIDIA's published scorers served by kvgate's cache, and
kvgate's linear / MLP gates written so that KVzap's loader reads them.

- a folder written by hand to KVzap's layout scores as a hand-computed Linear /
  Linear-GELU-Linear stack; a trained gate exported and loaded back scores and keeps the same;
- with KVzap's rule (raw score >= threshold, or among the last ``window`` tokens) the cache
  holds exactly those entries per head, at the prefill and while decoding, on LLaMA and Qwen3;
- bad input in one line each.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build, build_causal_lm, patch_evicting, tiny_llama_config, tiny_qwen3_config
from safetensors.torch import save_file

from kvgate.cache import CompressedCache
from kvgate.checkpoint import CheckpointError, export_kvzap, load_gated, read_meta
from kvgate.gate import gate_modules
from kvgate.models import dispatch
from kvgate.policies import Budget, PolicyError, get_policy

LLAMA = tiny_llama_config()  # 2 layers, hidden 64, 2 KV heads


def kvzap_folder(path, config, hidden_dim=None, prefix="layers", seed=0, scale=1.0):
    """A KVzap checkpoint written by hand, as ``KVzapModel.save_pretrained`` lays it out:
    returns the per-layer tensors by KVzap's names."""
    text = config
    g = torch.Generator().manual_seed(seed)
    d, h, n = text.hidden_size, text.num_key_value_heads, text.num_hidden_layers
    tensors = {}
    for i in range(n):
        if hidden_dim is None:
            tensors[f"{prefix}.{i}.weight"] = torch.randn(h, d, generator=g) * scale
            tensors[f"{prefix}.{i}.bias"] = torch.randn(h, generator=g) * scale
        else:
            tensors[f"{prefix}.{i}.0.weight"] = torch.randn(hidden_dim, d, generator=g) * 0.3
            tensors[f"{prefix}.{i}.0.bias"] = torch.randn(hidden_dim, generator=g) * 0.1
            tensors[f"{prefix}.{i}.2.weight"] = torch.randn(h, hidden_dim, generator=g) * scale
            tensors[f"{prefix}.{i}.2.bias"] = torch.randn(h, generator=g) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KVzapModel"], "model_type": "kvzap", "input_dim": d,
        "output_dim": h, "hidden_dim": hidden_dim, "n_modules": n, "dtype": "float32",
        "transformers_version": "4.57.0"}))
    return tensors


def by_hand(tensors, layer, hidden, hidden_dim, prefix="layers"):
    """KVzap's scorer of ``layer`` on ``hidden`` [B, n, D]: [B, H_kv, n]."""
    p = f"{prefix}.{layer}"
    if hidden_dim is None:
        out = hidden @ tensors[f"{p}.weight"].T + tensors[f"{p}.bias"]
    else:
        inner = torch.nn.functional.gelu(hidden @ tensors[f"{p}.0.weight"].T + tensors[f"{p}.0.bias"])
        out = inner @ tensors[f"{p}.2.weight"].T + tensors[f"{p}.2.bias"]
    return out.transpose(1, 2)


@pytest.mark.parametrize("hidden_dim", [None, 16], ids=["linear", "mlp"])
@pytest.mark.parametrize("prefix", ["layers", "module_list"])
def test_a_folder_in_kvzaps_layout_scores_as_its_stack_by_hand(tmp_path, hidden_dim, prefix):
    tensors = kvzap_folder(tmp_path / "kvzap", LLAMA, hidden_dim, prefix)
    model, _, meta = load_gated(tmp_path / "kvzap", base=build(LLAMA))
    assert meta["format"] == "kvzap" and meta["gate"]["kind"] == ("linear" if hidden_dim is None else "mlp")
    hidden = torch.randn(2, 7, LLAMA.hidden_size)
    for i, gate in enumerate(gate_modules(model)):
        torch.testing.assert_close(gate.scores(hidden), by_hand(tensors, i, hidden, hidden_dim, prefix),
                                   atol=1e-5, rtol=1e-5)


def _held(cache, layer, length):
    """[B, H_kv, length] bool: the positions a layer of the cache holds."""
    store = cache.layers[layer].store
    pos, valid = store.slot_positions(), store.slot_valid()
    width = max(length, int(pos.max()) + 1)
    held = torch.zeros(*pos.shape[:2], width + 1, dtype=torch.bool)
    return held.scatter_(-1, torch.where(valid, pos, width), True)[..., :length]


def _decode(model, policy, ids, steps, check):
    """Prefill ``ids`` [1, n], then ``steps`` greedy tokens; after each forward ``check(cache,
    seen)`` with every layer's gate inputs so far ([1, t, D] each)."""
    cache = CompressedCache(model, policy, Budget(ratio=1.0))
    seen: dict[int, list[torch.Tensor]] = {}

    def tap(module, query, key, value, attn_mask, scaling, call):
        seen.setdefault(module.layer_idx, []).append(call.hidden)

    with torch.no_grad(), dispatch.tapped(model, tap):
        out = model(ids, past_key_values=cache)
        for step in range(steps + 1):
            check(cache, {k: torch.cat(v, dim=1) for k, v in seen.items()})
            if step == steps:
                break
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("hidden_dim", [None, 16], ids=["linear", "mlp"])
def test_kvzaps_rule_holds_exactly_the_entries_above_the_threshold_or_in_the_window(
        tmp_path, arch, hidden_dim):
    config = LLAMA if arch == "llama" else tiny_qwen3_config()
    base = build(config) if arch == "llama" else build_causal_lm(config)
    tensors = kvzap_folder(tmp_path / "kvzap", config, hidden_dim)
    model, _, _ = load_gated(tmp_path / "kvzap", base=base)
    threshold, window = 0.0, 4  # KVzap's rule after every step (interval 1)
    policy = get_policy("local_gate", threshold=threshold, window=window, interval=1)
    ids = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    evicted, held_bytes = [], []

    def check(cache, seen):
        for layer, hidden in seen.items():
            length = hidden.shape[1]
            want = by_hand(tensors, layer, hidden, hidden_dim)[0] >= threshold
            want |= torch.arange(length) >= length - window
            assert torch.equal(_held(cache, layer, length)[0], want), (layer, length)
            assert torch.equal(cache.kept_counts(layer)[0], want.sum(-1))
            evicted.append(int((~want).sum()))
        held_bytes.append((cache.bytes_held(), cache.full_bytes()))

    _decode(model, policy, ids, 5, check)
    assert sum(evicted) > 0 and all(held < full for held, full in held_bytes)  # freed per head


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_trained_gate_exported_in_kvzaps_format_and_loaded_back_scores_and_keeps_the_same(
        tmp_path, kind):
    model = build(LLAMA)
    patch_evicting(model, kind, sinks=2)
    config = gate_modules(model)[0].config
    export_kvzap(model, tmp_path / "kvzap", gate_config=config, base_model="tiny")
    saved = json.loads((tmp_path / "kvzap" / "config.json").read_text())
    assert saved["model_type"] == "kvzap" and saved["n_modules"] == 2
    assert saved["hidden_dim"] == (None if kind == "linear" else 16)
    assert saved["kvgate"]["threshold"] == pytest.approx(
        math.log(config.tau / (1 - config.tau)) - config.gamma)
    back, _, meta = load_gated(tmp_path / "kvzap", base=build(LLAMA))
    assert meta["base"]["id"] == "tiny" and meta["gate"] == config.to_dict()
    hidden = torch.randn(1, 9, LLAMA.hidden_size)
    for a, b in zip(gate_modules(model), gate_modules(back), strict=True):
        assert torch.equal(a.scores(hidden), b.scores(hidden))
    ids = torch.randint(1, 100, (1, 14), generator=torch.Generator().manual_seed(5))
    masks = []
    for m, opts in ((model, {}), (back, {}), (back, {"threshold": saved["kvgate"]["threshold"]})):
        got = []
        _decode(m, get_policy("local_gate", window=3, **opts), ids, 3,
                lambda cache, seen, got=got: got.append(
                    [_held(cache, layer, h.shape[1]) for layer, h in seen.items()]))
        masks.append(got)
    flat = [torch.cat([m.flatten() for step in got for m in step]) for got in masks]
    assert torch.equal(flat[0], flat[1]) and torch.equal(flat[0], flat[2])  # threshold == tau
    assert not bool(flat[0].all())  # and something was evicted


def test_the_round_trip_through_the_export_command(tmp_path, capsys):
    """``kvgate export GATED OUT --format kvzap`` from a gated export, then ``kvgate infer
    --checkpoint OUT``: the same answer and kept share as the original export."""
    from kvtrain_fixtures import save_tiny_base

    from kvgate.checkpoint import export_gated
    from kvgate.cli import main as kvgate_main
    from kvgate.models import model_fingerprint

    base_dir = save_tiny_base(tmp_path / "base")
    model, _, _ = load_gated_base(base_dir)
    patch_evicting(model, "mlp")
    export_gated(model, tmp_path / "gated", base_model=base_dir,
                 fingerprint=model_fingerprint(model.config),
                 gate_config=gate_modules(model)[0].config)
    assert kvgate_main(["export", str(tmp_path / "gated"), str(tmp_path / "kvzap"),
                        "--format", "kvzap"]) == 0
    outputs = []
    for folder in ("gated", "kvzap"):
        capsys.readouterr()
        assert kvgate_main(["infer", "--checkpoint", str(tmp_path / folder), "--json",
                            "--prompt", "the cat sat on the mat and", "--max-new-tokens",
                            "4"]) == 0
        result = json.loads(capsys.readouterr().out)
        outputs.append((result["token_ids"], result["stats"]["kept_fraction"]))
    assert outputs[0] == outputs[1]


def load_gated_base(base_dir):
    from kvgate.models import load_base

    model, tok = load_base(base_dir)
    return model, tok, None


def test_bad_input_is_one_line_each(tmp_path):
    from kvgate.checkpoint.kvzap import kvzap_refusal
    from kvgate.gate import GateConfig

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="not a gated checkpoint"):
        read_meta(tmp_path / "plain")
    kvzap_folder(tmp_path / "kvzap", LLAMA, 16)
    with pytest.raises(CheckpointError, match="names no base model: pass base="):
        load_gated(tmp_path / "kvzap")
    for field, change, name in (("n_modules", {"num_hidden_layers": 3}, "layers"),
                                ("input_dim", {"hidden_size": 32, "intermediate_size": 64},
                                 "hidden size"),
                                ("output_dim", {"num_key_value_heads": 1}, "KV heads")):
        with pytest.raises(CheckpointError, match=f"another model: {field} is .*, the base "
                                                  f"has .* {name}") as err:
            load_gated(tmp_path / "kvzap", base=build(tiny_llama_config(**change)))
        assert "\n" not in str(err.value)
    assert "linear and mlp" in kvzap_refusal(GateConfig(kind="attention"))
    model = build(LLAMA)
    patch_evicting(model, "mlp")
    with pytest.raises(CheckpointError, match="^--format kvzap: a gate of kind 'attention'"):
        export_kvzap(model, tmp_path / "out", gate_config=GateConfig(kind="attention"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(PolicyError, match="tau .* or threshold .*, not both"):
        get_policy("local_gate", tau=0.5, threshold=-4)
    with pytest.raises(PolicyError, match="threshold"):
        get_policy("local_gate", threshold="low")


def test_a_hub_id_without_a_network_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^nvidia/KVzap-mlp-Tiny: no such checkpoint "
                                              r"folder here, and the hub cannot be reached") as err:
        load_gated("nvidia/KVzap-mlp-Tiny", base=build(LLAMA))
    assert "\n" not in str(err.value)


def test_a_cached_hub_snapshot_loads_offline(monkeypatch, tmp_path):
    """The real hub path: a repository already in the hub cache is read without a network."""
    cache = tmp_path / "hf" / "hub" / "models--nvidia--KVzap-linear-Tiny"
    snap = cache / "snapshots" / "abc123"
    tensors = kvzap_folder(snap, LLAMA)
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read by the hub client at import; where it looks is set on its constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    model, _, meta = load_gated("nvidia/KVzap-linear-Tiny", base=build(LLAMA))
    assert meta["format"] == "kvzap" and meta["gate"]["kind"] == "linear"
    hidden = torch.randn(1, 5, LLAMA.hidden_size)
    torch.testing.assert_close(gate_modules(model)[1].scores(hidden),
                               by_hand(tensors, 1, hidden, None), atol=1e-5, rtol=1e-5)


def test_the_command_line_serves_a_published_checkpoint_on_its_base(tmp_path, capsys):
    """``kvgate infer --checkpoint KVZAP --base BASE`` with KVzap's threshold; without --base,
    and ``--format kvzap`` of an attention gate, one line each (exit 2)."""
    from kvtrain_fixtures import save_tiny_base

    from kvgate.checkpoint import export_gated
    from kvgate.cli import main as kvgate_main
    from kvgate.gate import GateConfig, patch
    from kvgate.models import model_fingerprint

    base_dir = save_tiny_base(tmp_path / "base")
    kvzap_folder(tmp_path / "kvzap", LLAMA, 16)
    args = ["infer", "--checkpoint", str(tmp_path / "kvzap"), "--prompt", "the cat sat on the",
            "--max-new-tokens", "3", "--policy-opt", "local_gate.threshold=0",
            "--policy-opt", "local_gate.window=2", "--json"]
    assert kvgate_main([*args, "--base", base_dir]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert 0.0 < stats["kept_fraction"] < 1.0
    assert kvgate_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "--base" in err[-1]

    model, _, _ = load_gated_base(base_dir)
    patch(model, GateConfig(kind="attention"))
    export_gated(model, tmp_path / "attention", base_model=base_dir,
                 fingerprint=model_fingerprint(model.config), gate_config=GateConfig())
    assert kvgate_main(["export", str(tmp_path / "attention"), str(tmp_path / "out"),
                        "--format", "kvzap"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "kind 'attention'" in err[-1]
    assert not (tmp_path / "out").exists()
