"""One prefill for many one-shot policies (kvgate.cache.shared): each filled cache is the one
the policy builds alone, entry for entry, and continues like it."""

from __future__ import annotations

import pytest
import torch
from conftest import build, patch_evicting, tiny_mistral_config

from kvgate.cache import CacheError, CompressedCache
from kvgate.cache.shared import SharedPrefill, _fill_layer, shares_prefill
from kvgate.policies import get_policy, list_policies
from kvgate.policies.base import Budget, PolicyError
from kvgate.policies.contract import EncodeMasking, PassScoring, StreamingPrefill

SMALL = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4},
         "adakv": {"inner_options": {"window": 4}}, "ahakv": {"recent": 4},
         "h2o": {"recent": 0.5}, "gate_rank": {"window": 4}}
LEARNED = {"attention_gate", "local_gate"}
RANDOMISED = {"nacl", "random"}  # draw per call: a second run is another draw
# what evaluations share a prefill among: every test below checks such a policy's filled cache
ONE_SHOT = [n for n in list_policies() if shares_prefill(get_policy(n, **SMALL.get(n, {})))]
RANKS_THE_GATE = {"gate_rank"}  # one-shot too, but it reads a gated model's scores


@pytest.fixture(scope="module")
def model():
    return build(tiny_mistral_config(num_key_value_heads=2))


def _batch():
    """Two left-padded prompts of 24 and 15 tokens."""
    n, ids = 24, torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, k in enumerate((24, 15)):
        ids[i, n - k:] = torch.randint(1, 128, (k,), generator=torch.Generator().manual_seed(k))
        mask[i, n - k:] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _prefill(model, cache, ids, mask, pos):
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits


def _same_store(a: CompressedCache, b: CompressedCache) -> None:
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.store.kept_counts(), lb.store.kept_counts())
        for x, y in zip(la.store.base_kv(), lb.store.base_kv()):
            assert torch.equal(x, y)
        assert torch.equal(la.store.slot_positions(), lb.store.slot_positions())
        assert torch.equal(la.capacity, lb.capacity)
        assert (la.seen, la.real_seen.tolist()) == (lb.seen, lb.real_seen.tolist())
        assert la.stats.keys() == lb.stats.keys()
        for k in la.stats:
            assert torch.equal(la.stats[k], lb.stats[k])


def test_every_one_shot_policy_equals_its_own_prefill(model):
    """Each heuristic at two budgets, one prefill: the stores, decode statistics and
    capacities equal the policy's own run; the prefill's logits are the full cache's."""
    _equals_own_prefill(model, [n for n in ONE_SHOT if n not in RANKS_THE_GATE])


def test_the_gate_ranking_policy_equals_its_own_prefill():
    """The same for the policy that ranks a gate's scores, on a gated model."""
    model = build(tiny_mistral_config(num_key_value_heads=2))
    patch_evicting(model, "mlp")
    _equals_own_prefill(model, sorted(RANKS_THE_GATE))


def _equals_own_prefill(model, names: list[str]) -> None:
    ids, mask, pos = _batch()
    budgets = (0.5, 0.25)
    variants = {f"{n}@{b}": (get_policy(n, **SMALL.get(n, {})), Budget(ratio=b))
                for n in names for b in budgets}
    torch.manual_seed(0)
    shared = SharedPrefill(model, variants)
    logits = _prefill(model, shared, ids, mask, pos)
    full = _prefill(model, CompressedCache(model, get_policy("full"), 1.0), ids, mask, pos)
    assert torch.equal(logits, full)
    assert set(shared.seconds) == set(variants) and all(s >= 0 for s in shared.seconds.values())
    for name, (policy, budget) in variants.items():
        alone = CompressedCache(model, get_policy(policy.name, **SMALL.get(policy.name, {})),
                                budget)
        _prefill(model, alone, ids, mask, pos)
        got = shared.caches[name]
        if policy.name in RANDOMISED:  # another draw: only the counts must agree
            assert got.kept_fraction() == pytest.approx(alone.kept_fraction(), abs=0.05), name
            continue
        _same_store(got, alone)
        if policy.name != "full":
            assert got.kept_fraction() < 0.8, name


def test_a_filled_cache_decodes_like_its_own(model):
    """Greedy continuation over a shared-prefill cache equals generate with the policy alone
    (H2O holds its heads at capacity while decoding, so its statistics must be right)."""
    ids, mask, pos = _batch()
    gen = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    names = ("h2o", "snapkv", "tova")
    shared = SharedPrefill(model, {n: (get_policy(n, **SMALL.get(n, {})), 0.5) for n in names})
    first = _prefill(model, shared, ids, mask, pos)[:, -1]
    for n in names:
        want = model.generate(ids, attention_mask=mask, past_key_values=CompressedCache(
            model, get_policy(n, **SMALL.get(n, {})), 0.5), **gen)[:, ids.shape[1]:]
        got = _greedy(model, shared.caches[n], first, mask, pos)
        assert got.tolist() == want.tolist(), n


def test_shares_prefill_leaves_out_streamed_prefills_the_gates_and_extra_passes():
    left_out = {n for n in list_policies() if n not in ONE_SHOT}
    assert left_out == LEARNED | {"roco", "kvzip"}
    assert isinstance(get_policy("roco"), StreamingPrefill)
    assert isinstance(get_policy("kvzip"), PassScoring)  # its passes run over its own cache
    assert all(isinstance(get_policy(n), EncodeMasking) for n in LEARNED)


def test_refusals(model):
    ids, mask, pos = _batch()
    with pytest.raises(PolicyError, match="streams the prompt"):
        SharedPrefill(model, {"r": (get_policy("roco", block=4), 0.5)})
    with pytest.raises(PolicyError, match="chooses after extra passes"):
        SharedPrefill(model, {"k": (get_policy("kvzip"), 0.5)})
    with pytest.raises(PolicyError, match="at least one"):
        SharedPrefill(model, {})

    class Masking(type(get_policy("streaming")), EncodeMasking):  # encodes under its mask
        name = "masking"

    with pytest.raises(PolicyError, match="eq. 5"):
        _prefill(model, SharedPrefill(model, {"m": (Masking(), 0.5)}), ids, mask, pos)
    shared = SharedPrefill(model, {"s": (get_policy("streaming"), 0.5)})
    _prefill(model, shared, ids, mask, pos)
    with pytest.raises(CacheError, match="one prefill"):
        _prefill(model, shared, ids[:, :1], torch.cat([mask, mask[:, :1]], 1), pos[:, -1:] + 1)
    with pytest.raises(CacheError, match="already filled"):
        _fill_layer(shared.caches["s"], _a_prompt(model, ids, mask))


def _a_prompt(model, ids, mask):
    """A LayerPrompt of layer 0 (whatever its content: the cache refuses before reading)."""
    from kvgate.policies.base import LayerPrompt

    b, n = ids.shape
    hk, d = 2, model.config.hidden_size // model.config.num_attention_heads
    kv = torch.zeros(b, hk, n, d)
    return LayerPrompt(0, model.config.num_hidden_layers, torch.zeros(b, 4, n, d), kv, kv,
                       mask.bool(), d ** -0.5)


def _greedy(model, cache, first, mask, pos, steps=5):
    out, logits = [], first
    with torch.no_grad():
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = pos[:, -1:] + 1
            logits = model(nxt, attention_mask=mask, position_ids=pos,
                           past_key_values=cache).logits[:, -1]
    return torch.cat(out, dim=1)


def test_stacked_caches_decode_as_each_alone(model):
    """The caches one prompt left under several policies and budgets, stacked as the rows of
    one batch, continue exactly as each does alone; H2O (decode-evicting) stacks only with its
    own policy object; the originals are untouched."""
    from kvgate.cache.fork import fork_cache, stack_caches

    ids, mask, pos = _batch()
    ids, mask, pos = ids[:1], mask[:1], pos[:1]
    h2o = get_policy("h2o", **SMALL["h2o"])
    variants = {"snap": (get_policy("snapkv", window=4), 0.5), "knorm": (get_policy("knorm"), 0.3),
                "full": (get_policy("full"), 1.0), "pyr": (get_policy("pyramidkv", window=4), 0.5),
                "h2o_a": (h2o, 0.5), "h2o_b": (h2o, 0.25)}
    shared = SharedPrefill(model, variants)
    first = _prefill(model, shared, ids, mask, pos)[:, -1]
    counts = {n: [la.store.kept_counts().clone() for la in c.layers]
              for n, c in shared.caches.items()}
    for names in (["snap", "knorm", "full", "pyr"], ["h2o_a", "h2o_b"]):
        rows = len(names)
        stacked = stack_caches([shared.caches[n] for n in names])
        got = _greedy(model, stacked, first.expand(rows, -1), mask.expand(rows, -1),
                      pos.expand(rows, -1))
        for row, n in enumerate(names):
            alone = _greedy(model, fork_cache(shared.caches[n]), first, mask, pos)
            assert got[row].tolist() == alone[0].tolist(), n
    for n, c in shared.caches.items():  # stacking and decoding left the caches as they were
        assert all(torch.equal(a, la.store.kept_counts()) for a, la in zip(counts[n], c.layers))
    with pytest.raises(CacheError, match="same policy object"):
        stack_caches([shared.caches["h2o_a"], shared.caches["snap"]])
    other = CompressedCache(model, get_policy("full"), 1.0)
    _prefill(model, other, ids[:, 3:], mask[:, 3:], pos[:, 3:] - 3)
    with pytest.raises(CacheError, match="same model, prompt length"):
        stack_caches([shared.caches["snap"], other])
