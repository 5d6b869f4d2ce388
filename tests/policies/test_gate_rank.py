"""``gate_rank``: a trained gate's raw scores (local or attention kind) ranked under the budget,
per KV head or over all layers and heads at once, with the last ``window`` tokens and the
gate's sinks forced in."""

from __future__ import annotations

import pytest
import torch
from conftest import build, patch_evicting, tiny_llama_config

import kvgate
from kvgate.cache import CompressedCache
from kvgate.gate import GateConfig
from kvgate.inference.decode import left_padded_positions
from kvgate.policies import Budget, PolicyError, get_policy
from kvgate.policies.gate_rank import GateRank

WINDOW, SINKS = 3, 2


def _run(allocation: str, ratio: float = 0.4, kind: str = "mlp"):
    """Prefill a left-padded batch under gate_rank; every layer's (scores, forced) as the policy
    saw them and the cache. Samples: 30 and 21 real tokens. ``kind`` attention: the paper's
    Attention-Gate (configs/cpt_kvzap_attention.yaml's kind), randomly initialised."""
    seen = []

    class Spy(GateRank):
        def ranked(self, prompt):
            out = super().ranked(prompt)
            if not seen or seen[-1][0] is not out:
                seen.append((out, prompt.valid.clone()))
            return out

    model = build(tiny_llama_config())
    if kind == "attention":
        kvgate.patch(model, GateConfig(kind="attention", head_dim=8, sinks=SINKS))
    else:
        patch_evicting(model, kind, sinks=SINKS)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 98, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policy = Spy(window=WINDOW, allocation=allocation)
    cache = CompressedCache(model, policy, Budget(ratio=ratio))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
              past_key_values=cache, use_cache=True)
    return model, cache, [s[0] for s in seen], mask.bool()


def _kept_positions(cache) -> list[torch.Tensor]:
    """Per layer, [B, H_kv, n_prompt] bool over prompt positions (position = real index)."""
    out = []
    for layer in cache.layers:
        pos = layer.store.slot_positions()  # [B, H_kv, T], -1 where empty
        kept = torch.zeros(pos.shape[0], pos.shape[1], 30, dtype=torch.bool)
        b, h, t = (pos >= 0).nonzero(as_tuple=True)
        kept[b, h, pos[b, h, t]] = True
        out.append(kept)
    return out


def _real_aligned(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, H, 30] in column layout -> [B, H, 30] indexed by real position (left padding moved
    to the end), so it lines up with the store's positions."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):  # two samples
        n = int(valid[i].sum())
        out[i, :, :n] = x[i, :, valid[i]]
    return out


@pytest.mark.parametrize("allocation,kind", [("head", "mlp"), ("global", "mlp"),
                                             ("global", "attention")])
def test_kept_entries_are_the_forced_ones_and_the_highest_scores(allocation, kind):
    _, cache, seen, valid = _run(allocation, kind=kind)
    assert len(seen) == len(cache.layers)
    kept = _kept_positions(cache)
    scores = torch.stack([_real_aligned(s, valid) for s, _ in seen])  # [L, B, Hk, 30]
    forced = torch.stack([_real_aligned(f, valid) for _, f in seen])
    keep = torch.stack(kept)
    n_real = valid.sum(-1)
    real = torch.arange(30)[None, :] < n_real[:, None]  # [B, 30] in real-index layout
    real4 = real[None, :, None, :].expand_as(keep)
    assert not (keep & ~real4).any()
    # the window's last tokens and the sinks are forced and kept in every layer and head
    for i, n in enumerate(n_real.tolist()):
        assert forced[:, i, :, n - WINDOW:n].all() and forced[:, i, :, :SINKS].all()
    assert (keep | ~forced).all()
    budget = Budget(ratio=0.4).per_sample(n_real)  # per head, as the budget rounds it
    free = real4 & ~forced
    if allocation == "head":
        assert (keep.sum(-1) == budget[None, :, None]).all()
        lowest_kept = scores.masked_fill(~(keep & free), float("inf")).amin(-1)
        highest_out = scores.masked_fill(~(~keep & free), float("-inf")).amax(-1)
    else:
        layers, hk = keep.shape[0], keep.shape[2]
        assert keep.sum((0, 2, 3)).tolist() == (budget * layers * hk).tolist()
        counts = keep.sum(-1)
        assert counts.max() > counts.min()  # heads hold what their scores win, not alike
        per_sample = scores.permute(1, 0, 2, 3)
        lowest_kept = per_sample.masked_fill(~(keep & free).permute(1, 0, 2, 3),
                                             float("inf")).flatten(1).amin(-1)
        highest_out = per_sample.masked_fill(~(~keep & free).permute(1, 0, 2, 3),
                                             float("-inf")).flatten(1).amax(-1)
    assert (lowest_kept >= highest_out).all()


def test_the_scores_are_the_gates_own_and_decoding_keeps_every_new_token(monkeypatch):
    returned = []
    gate_cls = type(_run("global")[0].model.layers[0].self_attn.kv_gate)
    original = gate_cls.scores

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        returned.append(out.detach().clone())
        return out

    monkeypatch.setattr(gate_cls, "scores", spy)
    model, cache, seen, _ = _run("global")
    # the ranked scores are the gate's raw output, unscaled (KVzap's one scale across layers)
    assert len(returned) == len(seen) == len(cache.layers)
    for got, (scores, _) in zip(returned, seen):
        assert torch.equal(got.float(), scores)
    before = [layer.store.kept_counts().clone() for layer in cache.layers]
    with torch.no_grad():
        for step in range(4):
            ids = torch.full((2, 1), 7 + step)
            mask = torch.ones(2, 31 + step, dtype=torch.long)
            mask[1, :9] = 0
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for b, layer in zip(before, cache.layers):
        assert torch.equal(layer.store.kept_counts(), b + 4)


def test_needs_a_gated_model_and_checks_its_options():
    model = build(tiny_llama_config())
    cache = CompressedCache(model, get_policy("gate_rank"), Budget(ratio=0.5))
    with torch.no_grad(), pytest.raises(PolicyError, match="gate_rank needs a gated model"):
        model(input_ids=torch.randint(4, 98, (1, 12)), past_key_values=cache)
    with pytest.raises(PolicyError, match="window"):
        get_policy("gate_rank", window=-1)
    with pytest.raises(PolicyError, match="allocation"):
        get_policy("gate_rank", allocation="layer")
