"""``allocation="global"``: one ranking over all layers and KV heads keeps exactly the
bottom-k complement, through the cache (one-shot and decode-evicting scored policies, KVzip),
in a shared prefill, and is refused where it would be meaningless."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config
from inference.engine_toys import char_tokenizer

from kvgate.cache import CompressedCache
from kvgate.cache.shared import SharedPrefill
from kvgate.inference import Engine
from kvgate.inference.decode import left_padded_positions
from kvgate.policies import H2O, TOVA, Budget, KVzip, PolicyError, SnapKV, get_policy
from kvgate.policies.base import select_global


def bottom_k_complement(scores, kept, forced, valid) -> torch.Tensor:
    """The slow way: per sample, every (layer, head, slot) entry; forced ones, then the highest
    scores (ties to the lower layer, head, slot) up to ``kept * L * H_kv`` in all."""
    layers, b, hk, t = scores.shape
    out = torch.zeros(layers, b, hk, t, dtype=torch.bool)
    for i in range(b):
        entries = [(layer, h, s) for layer in range(layers) for h in range(hk) for s in range(t)
                   if valid[i, s]]
        total = int(kept[i]) * layers * hk
        must = [e for e in entries if forced[e[0], i, e[1], e[2]]]
        rest = sorted((e for e in entries if not forced[e[0], i, e[1], e[2]]),
                      key=lambda e: -float(scores[e[0], i, e[1], e[2]]))
        for e in (must + rest)[:total]:
            out[e[0], i, e[1], e[2]] = True
    return out


def test_select_global_is_the_bottom_k_complement():
    gen = torch.Generator().manual_seed(0)
    layers, b, hk, t = 3, 2, 2, 11
    scores = torch.rand(layers, b, hk, t, generator=gen)
    valid = torch.arange(t)[None, :] < torch.tensor([[11], [7]])
    forced = (torch.rand(layers, b, hk, t, generator=gen) < 0.1) & valid[None, :, None, :]
    kept = torch.tensor([4, 3])
    keep = select_global(scores, kept, forced, valid)
    assert torch.equal(keep, bottom_k_complement(scores, kept, forced, valid))
    assert keep.sum((0, 2, 3)).tolist() == [4 * 3 * 2, 3 * 3 * 2]
    assert not (keep & ~valid[None, :, None, :]).any() and (keep | ~forced).all()
    counts = keep.sum(-1)  # per (layer, sample, head): ragged, unlike the per-head budget
    assert counts.max() > counts.min()


def ids_and_mask():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 98, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # 21 real tokens
    return ids, mask


@pytest.mark.parametrize("cls, options", [(SnapKV, {"window": 3, "kernel": 3}),
                                          (H2O, {"recent": 2}), (TOVA, {})])
def test_the_cache_keeps_the_global_bottom_k_complement(cls, options):
    """Each layer's scores divided by their per-(layer, head) sum over the unforced real
    entries, then one ranking over both layers and both KV heads of each sample."""
    seen = []

    class Spy(cls):
        def global_scores(self, scores, candidates):
            out = super().global_scores(scores, candidates)
            seen.append((out.clone(), candidates.clone()))
            return out

    model = build(tiny_llama_config())
    ids, mask = ids_and_mask()
    budget = Budget(ratio=0.4)
    cache = CompressedCache(model, Spy(allocation="global", **options), budget)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
              past_key_values=cache, use_cache=True)
    valid = mask.bool()
    scores = torch.stack([s for s, _ in seen])  # [L, B, H_kv, n]
    candidates = torch.stack([c for _, c in seen])
    sums = (scores * candidates).sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))  # one unit per (layer, head)
    forced = valid[None, :, None, :] & ~candidates
    kept = budget.per_sample(valid.sum(-1))
    want = bottom_k_complement(scores, kept, forced, valid)
    pad = ids.shape[1] - valid.sum(-1)
    counts = []
    for layer in range(2):
        positions = cache.layers[layer].store.slot_positions()
        counts.append(cache.kept_counts(layer))
        for b in range(2):
            for h in range(2):
                got = set(positions[b, h].tolist()) - {-1}
                chosen = want[layer, b, h].nonzero().flatten().tolist()
                assert got == {p - int(pad[b]) for p in chosen}
    counts = torch.stack(counts)  # [L, B, H_kv]
    assert torch.equal(counts.sum((0, 2)), kept * 2 * 2)
    assert counts.max() > counts.min()  # heads keep what they won


def test_global_allocation_in_a_shared_prefill_equals_its_own_cache():
    model = build(tiny_llama_config())
    ids, mask = ids_and_mask()
    policy = SnapKV(window=3, kernel=3, allocation="global")
    own = CompressedCache(model, policy, 0.5)
    shared = SharedPrefill(model, {"g": (policy, 0.5), "h": (SnapKV(window=3, kernel=3), 0.5)})
    with torch.no_grad():
        for cache in (own, shared):
            model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
    for a, b in zip(own.layers, shared.caches["g"].layers):
        for name in ("keys", "values", "pos", "counts"):
            assert torch.equal(getattr(a.store, name), getattr(b.store, name))
    assert shared.caches["g"].kept_fraction() == own.kept_fraction()
    per_head = shared.caches["h"]
    assert not torch.equal(own.kept_counts(0), per_head.kept_counts(0))


def test_kvzip_ranks_its_raw_scores_globally():
    seen = {}

    class Spy(KVzip):
        def choose(self, scores, valid, budget):
            seen["scores"], seen["valid"] = scores.clone(), valid.clone()
            seen["keep"] = super().choose(scores, valid, budget)
            return seen["keep"]

    tok = char_tokenizer()
    ids, mask = ids_and_mask()
    budget = Budget(ratio=0.3)
    _, cache = Engine(build(tiny_llama_config()), tok, Spy(allocation="global", chunk=12),
                      budget).prefill(ids, mask)
    scores, valid = seen["scores"], seen["valid"]
    sinks = (torch.arange(valid.shape[1]) < 4)[None, None, None, :].expand_as(scores)
    want = bottom_k_complement(scores, budget.per_sample(valid.sum(-1)), sinks, valid)
    assert torch.equal(seen["keep"], want)
    counts = torch.stack([cache.kept_counts(layer) for layer in range(2)])
    assert torch.equal(counts, want.sum(-1)) and counts.max() > counts.min()


def test_a_decode_evicting_policy_holds_each_head_at_what_it_won():
    model = build(tiny_llama_config())
    engine = Engine(model, char_tokenizer(), H2O(recent=2, allocation="global"), 0.5)
    cache = engine.new_cache()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
              past_key_values=cache, use_cache=True)
        after = [cache.kept_counts(layer).clone() for layer in range(2)]
        nxt = torch.tensor([[5], [6]])
        model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], dim=1),
              position_ids=mask.sum(-1, keepdim=True), past_key_values=cache, use_cache=True)
    for layer in range(2):
        assert torch.equal(cache.kept_counts(layer), after[layer])
    assert not torch.equal(after[0], after[0][:, :1].expand_as(after[0]))


def test_where_global_allocation_is_refused():
    with pytest.raises(PolicyError, match=r"pyramidkv.allocation: must be one of head \(got"):
        get_policy("pyramidkv", allocation="global")
    with pytest.raises(PolicyError, match="has no option 'allocation'"):
        get_policy("knorm", allocation="global")
    with pytest.raises(PolicyError, match="adakv.inner: reallocates within each layer"):
        get_policy("adakv", inner_options={"allocation": "global"})
    with pytest.raises(PolicyError, match="snapkv.allocation: must be one of head, global"):
        get_policy("snapkv", allocation="layer")
    from policy_testing import make_prompt

    with pytest.raises(PolicyError, match="ranks all layers at once") as err:
        get_policy("snapkv", allocation="global").keep(make_prompt(), Budget(tokens=4))
    assert "\n" not in str(err.value)
