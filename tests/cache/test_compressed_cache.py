"""CompressedCache against the plain model: identity at full budget, exact positions and
masks after eviction, batching with left padding, eq. 5 prefill, decode-time capacity."""

from __future__ import annotations

import pytest
import torch
from cache_toys import (
    EncodePattern,
    KeepAll,
    NewestPolicy,
    PatternPolicy,
    StreamNewest,
    pattern,
    real_positions,
)
from conftest import build, tiny_llama_config
from transformers import DynamicCache

from kvgate.cache import CacheError, CompressedCache
from kvgate.models import dispatch
from kvgate.policies.base import Budget, Policy, PolicyError


def _ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, n), generator=g)


def _window(model) -> int | None:
    return getattr(model.config, "sliding_window", None)


def _group(model) -> int:
    return model.config.num_attention_heads // model.config.num_key_value_heads


def _reference_logits(model, ids: torch.Tensor, visible: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain model (no cache) under an explicit per-query-head mask ``[B, H, N, N]``."""
    with torch.no_grad():
        return model(ids, attention_mask=visible, position_ids=position_ids,
                     use_cache=False).logits


def _base_mask(n: int, window: int | None) -> torch.Tensor:
    j = torch.arange(n)[:, None]
    t = torch.arange(n)[None, :]
    allowed = t <= j
    if window:
        allowed &= t > j - window
    return allowed


def _greedy(model, ids, cache, steps: int, mask=None):
    """Prefill + ``steps`` greedy decode steps; returns (fed ids, logits of every step)."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        fed = ids
        for _ in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True)
            fed = torch.cat([fed, nxt], dim=1)
            out = model(nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return fed, torch.stack(logits, dim=1), out


# --------------------------------------------------------------------------- full budget


def test_keep_all_generate_equals_plain_generate(tiny_model):
    ids = _ids(20)  # longer than the tiny Mistral's sliding window (8)
    ref = tiny_model.generate(ids, max_new_tokens=12, do_sample=False)
    cache = CompressedCache(tiny_model, KeepAll(), Budget(ratio=1.0))
    out = tiny_model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert out.tolist() == ref.tolist()
    assert cache.kept_fraction() == 1.0
    assert cache.get_seq_length() == 20 + 11


def test_keep_all_next_token_logits_identical(tiny_model):
    ids = _ids(15)
    dispatch.install(tiny_model)
    with torch.no_grad():
        dense = DynamicCache(config=tiny_model.config)
        full = tiny_model(ids, past_key_values=dense, use_cache=True)
        nxt = full.logits[:, -1:].argmax(-1)
        full2 = tiny_model(nxt, past_key_values=dense, use_cache=True)
    cache = CompressedCache(tiny_model, KeepAll(), Budget(tokens=64))
    _, logits, _ = _greedy(tiny_model, ids, cache, 1)
    torch.testing.assert_close(logits[:, 0], full.logits[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[:, 1], full2.logits[:, -1], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- memory


class EveryOther(Policy):
    name = "every_other"

    def keep(self, prompt, budget):
        b, hk, n = prompt.key.shape[:3]
        pos = real_positions(prompt.valid)
        return ((pos % 2 == 0) & prompt.valid)[:, None, :].expand(b, hk, n)


@pytest.mark.parametrize("policy", [EveryOther(), PatternPolicy()], ids=["uniform", "ragged"])
def test_bytes_held_follow_kept_entries(policy):
    model = build(tiny_llama_config(num_key_value_heads=4, num_attention_heads=4))
    ids = _ids(60, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0  # left padding: the samples keep different numbers too
    cache = CompressedCache(model, policy, Budget(ratio=0.5))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    cfg = model.config
    per_entry = 2 * cfg.head_dim * 4  # K and V, fp32
    kept = sum(int(cache.kept_counts(i).sum()) for i in range(cfg.num_hidden_layers))
    held = cache.bytes_held()
    assert kept * per_entry <= held <= 1.05 * kept * per_entry
    counts = torch.stack([cache.kept_counts(i) for i in range(cfg.num_hidden_layers)])
    padded = int(counts.max()) * counts.numel() * per_entry  # a layout padded to the longest head
    if isinstance(policy, PatternPolicy):
        assert counts.max() > 4 * counts.min()  # strongly head-varying
        assert held < 0.7 * padded
    assert held < cache.full_bytes()
    assert cache.full_bytes() == 2 * 4 * 60 * per_entry * cfg.num_hidden_layers
    assert cache.seen_tokens.tolist() == [60, 35]


# --------------------------------------------------------------------------- positions


def test_decode_after_eviction_matches_masked_full_model(tiny_model):
    """Per-head eviction, then decoding: each step's logits equal a plain full-sequence run
    whose mask hides the evicted entries from the rows after the prompt (true positions)."""
    n, steps = 14, 5
    ids = _ids(n, seed=3)
    cache = CompressedCache(tiny_model, PatternPolicy(), Budget(ratio=0.5))
    fed, logits, _ = _greedy(tiny_model, ids, cache, steps)
    total = fed.shape[1]
    g = _group(tiny_model)
    heads = tiny_model.config.num_attention_heads
    visible = _base_mask(total, _window(tiny_model)).repeat(1, heads, 1, 1)
    t = torch.arange(total)
    for hq in range(heads):
        kept = pattern(t, hq // g, n) | (t >= n)
        visible[0, hq, n:] &= kept[None, :]
    ref = _reference_logits(tiny_model, fed, visible)
    torch.testing.assert_close(logits[0], ref[0, n - 1:], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == total
    assert cache.kept_fraction(0) < 0.8


def test_encode_mask_prefill_matches_eq5_reference(tiny_model):
    ids = _ids(18, batch=2, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    cache = CompressedCache(tiny_model, EncodePattern(), Budget(ratio=0.5))
    with torch.no_grad():
        got = tiny_model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    n = ids.shape[1]
    g = _group(tiny_model)
    heads = tiny_model.config.num_attention_heads
    valid = mask.bool()
    pos = real_positions(valid)
    visible = _base_mask(n, _window(tiny_model)).repeat(2, heads, 1, 1)
    eye = torch.eye(n, dtype=torch.bool)
    for b in range(2):
        n_real = int(valid[b].sum())
        for hq in range(heads):
            keep = pattern(pos[b], hq // g, n_real)
            visible[b, hq] &= (keep[None, :] | eye) & valid[b][None, :]
        visible[b, :, ~valid[b]] = eye[~valid[b]]  # padding rows: anything finite
    ref = _reference_logits(tiny_model, ids, visible, position_ids=pos.clamp(min=0))
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-4, rtol=0)
    # and eq. 5 really changed the prefill: a full prefill gives other logits
    with torch.no_grad():
        plain = tiny_model(ids, attention_mask=mask, position_ids=pos.clamp(min=0)).logits
    assert (plain[valid] - got[valid]).abs().max() > 1e-3


# --------------------------------------------------------------------------- batching


@pytest.mark.parametrize("make", [PatternPolicy, NewestPolicy, lambda: StreamNewest(block=3)],
                         ids=["oneshot", "decode_evict", "stream"])
def test_batched_left_padding_equals_one_by_one(tiny_model, make):
    lengths = [13, 7]
    prompts = [_ids(k, seed=10 + k)[0] for k in lengths]
    n = max(lengths)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = p
        mask[i, n - len(p):] = 1
    budget = Budget(ratio=0.5)
    cache = CompressedCache(tiny_model, make(), budget)
    gen = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    batched = tiny_model.generate(ids, attention_mask=mask, past_key_values=cache, **gen)[:, n:]
    for i, p in enumerate(prompts):
        alone_cache = CompressedCache(tiny_model, make(), budget)
        alone = tiny_model.generate(p[None], past_key_values=alone_cache, **gen)[:, len(p):]
        assert batched[i].tolist() == alone[0].tolist(), f"sample {i}"
        assert alone_cache.kept_counts(1)[0].tolist() == cache.kept_counts(1)[i].tolist()
    assert cache.kept_fraction() < 0.9


# --------------------------------------------------------------------------- decode eviction


def test_decode_eviction_holds_capacity():
    model = build(tiny_llama_config())
    policy = NewestPolicy()
    cache = CompressedCache(model, policy, Budget(tokens=6))
    ids = _ids(16, seed=5)
    with torch.no_grad():
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        after_prefill = [cache.kept_counts(i).clone() for i in range(2)]
        held = cache.bytes_held()
        for _ in range(12):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for i in range(2):
                assert torch.equal(cache.kept_counts(i), after_prefill[i])
            assert cache.bytes_held() == held
    assert after_prefill[0].tolist() == [[6, 6]]
    assert policy.selects == 12 * 2 and policy.prefill_rounds == 0  # decoding: prefill=False
    assert cache.seen_tokens.tolist() == [16 + 12]
    assert cache.get_seq_length() == 28


def test_decode_budget_sets_capacity():
    model = build(tiny_llama_config())
    cache = CompressedCache(model, NewestPolicy(), Budget(tokens=10), decode_budget=4)
    _greedy(model, _ids(16), cache, 3)
    assert cache.kept_counts(0).tolist() == [[4, 4]]
    ratio = CompressedCache(model, NewestPolicy(), Budget(tokens=10), decode_budget=0.25)
    _greedy(model, _ids(16), ratio, 2)
    assert ratio.kept_counts(1).tolist() == [[4, 4]]


def test_stream_prefill_matches_blockwise_reference(tiny_model):
    """Evict-while-encoding: each prompt block sees only what the earlier blocks left."""
    n, cap, block, steps = 17, 6, 3, 4
    ids = _ids(n, seed=6)
    policy = StreamNewest(block=block)
    cache = CompressedCache(tiny_model, policy, Budget(tokens=cap))
    fed, logits, _ = _greedy(tiny_model, ids, cache, steps)
    # blocks 5-7, 8-10, 11-13, 14-16 in every layer are prefill=True rounds, the steps are not
    layers = tiny_model.config.num_hidden_layers
    assert policy.prefill_rounds == 4 * layers and policy.selects == (4 + steps) * layers
    with torch.no_grad():
        prefill_logits = tiny_model(ids, past_key_values=CompressedCache(
            tiny_model, StreamNewest(block=block), Budget(tokens=cap))).logits
    total = fed.shape[1]
    visible = _base_mask(total, _window(tiny_model))
    # aligned to the end: boundaries 17, 14, 11, 8, 5, 2; 0..4 fit the capacity at once
    starts = {j: (j if j >= n else 5 + (j - 5) // block * block) for j in range(5, total)}
    for j, lo in starts.items():
        t = torch.arange(total)
        held = (t < lo) & ((t == 0) | (t >= lo - (cap - 1))) if lo > cap else t < lo
        visible[j] &= held | (t >= lo)
    ref = _reference_logits(tiny_model, fed, visible[None].expand(1, -1, -1, -1))
    torch.testing.assert_close(prefill_logits[0], ref[0, :n], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[0], ref[0, n - 1:], atol=1e-4, rtol=0)
    assert cache.kept_counts(0).tolist()[0] == [cap] * tiny_model.config.num_key_value_heads


# --------------------------------------------------------------------------- misuse


def test_missing_install_is_a_clear_error():
    model = build(tiny_llama_config())
    cache = CompressedCache(model.config, KeepAll(), Budget(ratio=1.0))
    with pytest.raises(CacheError, match="dispatch.install"):
        model.generate(_ids(6), max_new_tokens=3, do_sample=False, past_key_values=cache)


def test_bad_keep_shape_and_batch_change_are_clear_errors():
    model = build(tiny_llama_config())

    class Broken(Policy):
        name = "broken"

        def keep(self, prompt, budget):
            return torch.ones(1, 1, 3, dtype=torch.bool)

    with pytest.raises(PolicyError, match="returned keep of shape"):
        model(_ids(6), past_key_values=CompressedCache(model, Broken(), Budget(ratio=0.5)))
    cache = CompressedCache(model, KeepAll(), Budget(ratio=1.0))
    model(_ids(6), past_key_values=cache)
    with pytest.raises(CacheError, match="new cache for a new batch"):
        model(_ids(1, batch=2), past_key_values=cache)


def test_unsupported_operations_and_backend_refusal():
    model = build(tiny_llama_config())
    cache = CompressedCache(model, KeepAll(), Budget(ratio=1.0))
    with pytest.raises(CacheError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))

    class Scored(KeepAll):
        name = "scored"
        needs_attention = True

    with pytest.raises(PolicyError, match="needs attention scores"):
        CompressedCache(model, Scored(), Budget(ratio=0.5), allow_attention_scores=False)
    with pytest.raises(PolicyError, match="decode_budget"):
        CompressedCache(model, KeepAll(), Budget(ratio=0.5), decode_budget=1.5)
