"""StaticDecodeCache + GraphedDecoder on the CPU: the fixed-shape decode step computes what
CompressedCache computes, and is capturable (same ops and shapes every step, no host reads)."""

from __future__ import annotations

import collections

import pytest
import torch
from cache_toys import NewestPolicy, PatternPolicy
from conftest import build, tiny_llama_config, tiny_mistral_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, StaticCache

from kvgate.cache import CacheError, CompressedCache
from kvgate.cache.fork import fork_cache
from kvgate.cache.static import StaticDecodeCache
from kvgate.inference.graphed import GraphedDecoder
from kvgate.policies import get_policy
from kvgate.policies.base import Budget


def _padded(lengths, seed=3):
    n = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(lengths):
        ids[i, n - k:] = torch.randint(1, 128, (k,), generator=g)
        mask[i, n - k:] = 1
    return ids, mask


def _prefill(model, policy, ids, mask):
    cache = CompressedCache(model, policy, Budget(ratio=0.5))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1]


def _dynamic(model, cache, first, mask, steps):
    """Greedy decode over the CompressedCache the way transformers' generate feeds it."""
    logits, pos = [first], (mask.sum(-1, keepdim=True))
    with torch.no_grad():
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(logits[-1].argmax(-1, keepdim=True), attention_mask=mask,
                        position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            pos = pos + 1
    return torch.stack(logits, 1)


def _static(model, frozen, first, mask, steps, seen):
    dec = GraphedDecoder(model, frozen, mask.sum(-1, keepdim=True), seen, steps)
    logits = [first]
    for _ in range(steps):
        logits.append(dec.step(logits[-1].argmax(-1)).clone())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("policy", [PatternPolicy(), get_policy("snapkv", window=4),
                                    get_policy("adakv", inner_options={"window": 4})],
                         ids=["ragged_pattern", "snapkv", "adakv"])
def test_static_decode_equals_the_compressed_cache(policy):
    model = build(tiny_llama_config())
    ids, mask = _padded([19, 12])
    cache, first = _prefill(model, policy, ids, mask)
    frozen = StaticDecodeCache.freeze(fork_cache(cache), 6)
    assert cache.kept_fraction() < 0.75
    # padded base: the two prompts' lengths differ, and Ada-KV / the pattern split by head
    assert all(la.base_visible is not None for la in frozen.layers)
    want = _dynamic(model, cache, first, mask, 6)
    got = _static(model, frozen, first, mask, 6, ids.shape[1])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(got, want, atol=1e-5)
    assert frozen.steps_taken == 6 and int(frozen.step) == 6
    assert frozen.get_seq_length() == ids.shape[1] + 6


def test_tokens_appended_before_the_freeze_start_the_tail():
    """A question fed over a compressed context (left-padded, two lengths) sits in the tail."""
    model = build(tiny_llama_config())
    ids, mask = _padded([20, 20])
    cache, _ = _prefill(model, get_policy("snapkv", window=4), ids, mask)
    q, qmask = _padded([5, 3], seed=9)
    mask = torch.cat([mask, qmask], 1)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q.shape[1]:]
    with torch.no_grad():
        first = model(q, attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True).logits[:, -1]
    frozen = StaticDecodeCache.freeze(fork_cache(cache), 4)
    assert frozen.start == q.shape[1]
    want = _dynamic(model, cache, first, mask, 4)
    got = _static(model, frozen, first, mask, 4, mask.shape[1])
    assert torch.allclose(got, want, atol=1e-5)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.calls.append((str(func.overloadpacket), shapes))
        return func(*args, **(kwargs or {}))


def test_every_step_runs_the_same_ops_on_the_same_shapes_and_never_reads_the_device():
    """What a CUDA graph needs: the second and third steps dispatch the same ops on the same
    shapes, and none copies a device value to the host (``.item()`` / ``bool(tensor)``)."""
    model = build(tiny_llama_config())
    ids, mask = _padded([16, 9])
    cache, first = _prefill(model, get_policy("adakv", inner_options={"window": 4}), ids, mask)
    dec = GraphedDecoder(model, StaticDecodeCache.freeze(cache, 5), mask.sum(-1, keepdim=True),
                         ids.shape[1], 5)
    token = first.argmax(-1)
    runs = []
    for _ in range(3):
        with _Ops() as ops:
            token = dec.step(token).argmax(-1)
        runs.append(ops.calls)
    assert runs[1] == runs[2] and len(runs[1]) > 20
    reads = {"aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.masked_select"}
    assert not reads & {name for name, _ in runs[1]}
    # the compressed cache's own step is not like that (its tail grows): the check can fail
    grows = CompressedCache(model, get_policy("snapkv", window=4), Budget(ratio=0.5))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=grows, use_cache=True)
        steps = []
        for _ in range(2):
            with _Ops() as ops:
                model(token[:, None], past_key_values=grows, use_cache=True)
            steps.append(ops.calls)
    assert steps[0] != steps[1]


def test_the_driver_runs_transformers_static_cache_like_a_dynamic_one():
    """The dense baseline of bench_decode: StaticCache through the same driver."""
    model = build(tiny_llama_config())
    ids = _padded([14])[0]
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        out = model(ids, past_key_values=dyn, use_cache=True)
        static = StaticCache(config=model.config, max_cache_len=14 + 5)
        first = model(ids, past_key_values=static, use_cache=True).logits[:, -1]
        want = [out.logits[:, -1]]
        for i in range(4):
            nxt = want[-1].argmax(-1, keepdim=True)
            want.append(model(nxt, past_key_values=dyn, use_cache=True,
                              position_ids=torch.tensor([[14 + i]])).logits[:, -1])
    dec = GraphedDecoder(model, static, torch.tensor([[14]]), 14, 4)
    got = [first]
    for _ in range(4):
        got.append(dec.step(got[-1].argmax(-1)).clone())
    assert torch.allclose(torch.stack(got, 1), torch.stack(want, 1), atol=1e-5)


@pytest.mark.parametrize("kind", ["static_dense", "compressed"])
def test_warm_up_steps_leave_no_trace_in_either_cache(kind):
    """The steps run before a CUDA graph capture are undone: transformers' StaticCache writes at
    its layers' own device counters, which a warm-up advances (on an H100 the captured steps
    then wrote past the cache's end: an index_copy_ out of bounds)."""
    model = build(tiny_llama_config())
    ids, mask = _padded([14])
    runs = []
    for warm in (0, 3):
        with torch.no_grad():
            if kind == "static_dense":
                cache = StaticCache(config=model.config, max_cache_len=14 + 4)
                first = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            else:
                compressed, first = _prefill(model, get_policy("snapkv"), ids, mask)
                cache = StaticDecodeCache.freeze(compressed, 4)
        dec = GraphedDecoder(model, cache, torch.tensor([[14]]), 14, 4, graphs=False)
        dec._warm(warm)
        got = [first]
        for _ in range(4):
            got.append(dec.step(got[-1].argmax(-1)).clone())
        runs.append(torch.stack(got, 1))
    torch.testing.assert_close(runs[1], runs[0])


def test_clear_errors():
    model = build(tiny_llama_config())
    ids, mask = _padded([12])
    with pytest.raises(CacheError, match="evicts while decoding"):
        StaticDecodeCache.freeze(_prefill(model, NewestPolicy(), ids, mask)[0], 4)
    with pytest.raises(CacheError, match="filled cache"):
        StaticDecodeCache.freeze(CompressedCache(model, PatternPolicy(), Budget(ratio=0.5)), 4)
    cache, first = _prefill(model, PatternPolicy(), ids, mask)
    with pytest.raises(CacheError, match="max_new_tokens"):
        StaticDecodeCache.freeze(cache, 0)
    with pytest.raises(CacheError, match="CompressedCache"):
        StaticDecodeCache.freeze(DynamicCache(), 4)
    dec = GraphedDecoder(model, StaticDecodeCache.freeze(cache, 2), mask.sum(-1, keepdim=True),
                         12, 2)
    dec.step(first.argmax(-1))
    dec.step(first.argmax(-1))
    with pytest.raises(CacheError, match="room for 2"):
        dec.step(first.argmax(-1))
    with pytest.raises(CacheError, match="CUDA device"):
        GraphedDecoder(model, StaticDecodeCache.freeze(cache, 2), mask.sum(-1, keepdim=True),
                       12, 2, graphs=True)
    with pytest.raises(CacheError, match="fixed-shape cache"):
        GraphedDecoder(model, DynamicCache(), mask.sum(-1, keepdim=True), 12, 2)
    with pytest.raises(CacheError, match="next_pos"):
        GraphedDecoder(model, StaticDecodeCache.freeze(cache, 2), mask.sum(-1), 12, 2)
    with pytest.raises(CacheError, match="max_steps"):
        GraphedDecoder(model, StaticDecodeCache.freeze(cache, 2), mask.sum(-1, keepdim=True),
                       12, 0)
    frozen = StaticDecodeCache.freeze(cache, 2)
    with torch.no_grad(), pytest.raises(CacheError, match="one new token"):
        model(ids[:, :2], past_key_values=frozen, use_cache=True)
    mistral = build(tiny_mistral_config())
    ids, mask = _padded([12])
    cache, first = _prefill(mistral, PatternPolicy(), ids, mask)
    with torch.no_grad(), pytest.raises(CacheError, match="sliding-window"):
        mistral(first.argmax(-1, keepdim=True), past_key_values=StaticDecodeCache.freeze(
            cache, 2), use_cache=True)


def test_op_counter_sees_ops():  # the dispatch mode the capturability test relies on
    with _Ops() as ops:
        torch.ones(2) + 1
    assert collections.Counter(n for n, _ in ops.calls)["aten.add"] == 1


def test_a_model_not_routed_through_kvgate_is_a_clear_error():
    from kvgate.models import dispatch

    model = build(tiny_llama_config())
    ids, mask = _padded([12])
    cache, first = _prefill(model, PatternPolicy(), ids, mask)
    frozen = StaticDecodeCache.freeze(cache, 3)
    dispatch.uninstall(model)
    with torch.no_grad(), pytest.raises(CacheError, match="never called"):
        for _ in range(2):
            model(first.argmax(-1, keepdim=True), past_key_values=frozen, use_cache=True)
