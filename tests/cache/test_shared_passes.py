"""One prefill and one run of KVzip's repeat pass for many variants (kvgate.cache.shared_passes):
each split cache is the one the variant builds alone, entry for entry, and continues like it."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config
from inference.engine_toys import char_tokenizer

from kvgate.cache import CacheError, CompressedCache
from kvgate.cache.shared_passes import SharedPasses, share_group
from kvgate.inference import Engine
from kvgate.inference.compress import (
    answer_rows,
    compress_rows_shared,
    compress_shared,
    prefill_rows,
)
from kvgate.policies import Budget, KVzip, PolicyError, get_policy

CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return build(tiny_llama_config())  # GQA: 4 query heads over 2 KV heads


def rows() -> list[list[int]]:
    """Two contexts of 40 and 27 tokens: left padding, three and two chunks."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, 98, (40,), generator=gen).tolist(),
            torch.randint(4, 98, (27,), generator=gen).tolist()]


VARIANTS = {f"{name}@{b}": (KVzip(chunk=CHUNK, plus=plus, allocation=alloc, sinks=sinks),
                            Budget(ratio=b))
            for name, plus, alloc, sinks in (("kvzip", False, "head", 4),
                                             ("kvzip_g", False, "global", 4),
                                             ("kvzipp", True, "head", 2),
                                             ("kvzipp_g", True, "global", 4))
            for b in (0.5, 0.25)}


def _same(a: CompressedCache, b: CompressedCache) -> None:
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "pos", "counts"):
            assert torch.equal(getattr(la.store, name), getattr(lb.store, name)), name
        assert torch.equal(la.capacity, lb.capacity)
        assert (la.seen, la.real_seen.tolist()) == (lb.seen, lb.real_seen.tolist())
        assert la.scores is None and lb.scores is None
    assert not a.awaiting_passes and a.bytes_held() == b.bytes_held()


def test_every_variant_equals_its_own_prefill_and_passes(model):
    """KVzip and KVzip+ (two scorers), per head and global, two budgets, other sinks: eight
    caches from one prefill and one repeat pass, each equal to the variant's own run; the
    shared cache keeps one row of running scores per scorer and is left unchanged."""
    tok = char_tokenizer()
    engine = Engine(model, tok, "full", 1.0)
    shared = SharedPasses(model, VARIANTS)
    assert len(shared.scorers) == 2
    prefill_rows(engine, rows(), shared, choose=False)
    assert shared.awaiting_passes and shared.layers[0].scores.shape[0] == 2
    before = [layer.scores.clone() for layer in shared.layers]
    caches, seconds = shared.split()
    assert set(caches) == set(seconds) == set(VARIANTS)
    for layer, scores in zip(shared.layers, before):
        assert torch.equal(layer.scores, scores)
    for name, (policy, budget) in VARIANTS.items():
        alone = prefill_rows(Engine(model, tok, policy, budget), rows(),
                             CompressedCache(model, policy, budget))[0].cache
        _same(caches[name], alone)
    # the allocation and the scorer change what is kept
    keys = [caches[n].layers[1].store.pos for n in ("kvzip@0.5", "kvzip_g@0.5", "kvzipp@0.5")]
    assert not torch.equal(keys[0], keys[1]) and not torch.equal(keys[0], keys[2])


def test_a_split_cache_answers_like_its_own(model):
    """The compressed contexts of ``compress_rows_shared`` decode greedily as the variant's
    own compress does."""
    tok = char_tokenizer()
    names = ("kvzip_g@0.25", "kvzipp@0.5")
    want = {n: VARIANTS[n] for n in names}
    shared, _ = compress_rows_shared(Engine(model, tok, "full", 1.0), [rows()[0]], want)
    for n, (policy, budget) in want.items():
        engine = Engine(model, tok, policy, budget)
        alone = prefill_rows(engine, [rows()[0]], engine.new_cache())[0]
        q = [[5, 6, 7]]
        assert answer_rows(engine, shared[n], q, 6) == answer_rows(engine, alone, q, 6), n
        assert shared[n].kept_fraction == pytest.approx(alone.kept_fraction)
    # contexts as text, through the chat-less char tokenizer: the same caches as compress
    text = "".join(chr(c) for c in rows()[1])
    by_text, _ = compress_shared(Engine(model, tok, "full", 1.0), text, want)
    for n, (policy, budget) in want.items():
        alone = Engine(model, tok, policy, budget).compress(text)
        _same(by_text[n].cache, alone.cache)


def test_groups_and_refusals(model):
    assert share_group(get_policy("snapkv")) == "prefill"
    assert share_group(get_policy("roco")) is None
    assert share_group(KVzip(plus=True, allocation="global")) == share_group(KVzip())
    assert share_group(KVzip(chunk=8)) != share_group(KVzip())
    with pytest.raises(PolicyError, match="same passes"):
        SharedPasses(model, {"a": (KVzip(chunk=8), 0.5), "b": (KVzip(), 0.5)})
    with pytest.raises(PolicyError, match="runs no extra passes"):
        SharedPasses(model, {"a": (KVzip(), 0.5), "s": (get_policy("snapkv"), 0.5)})
    with pytest.raises(PolicyError, match="at least one"):
        SharedPasses(model, {})
    shared = SharedPasses(model, VARIANTS)
    with pytest.raises(CacheError, match="after its prefill and passes"):
        shared.split()
    # run_passes' own choice would rank the scorers' rows as one: refused
    with pytest.raises(CacheError, match="split"):
        prefill_rows(Engine(model, char_tokenizer(), "full", 1.0), rows(), shared)
