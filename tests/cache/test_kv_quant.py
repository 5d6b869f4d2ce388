"""Kept entries in 8 or 4 bits (kvgate.cache.quant, rows, ragged): the codec's error bound, the
store's residual window bit-equal through every way rows move, bytes held summed from the real
storage, and the quantized cache's attention against the full-precision cache on tiny LLaMA /
Qwen3 at the prefill and over 32 decode steps with eviction."""

from __future__ import annotations

import pytest
import torch
from cache_toys import NewestPolicy
from conftest import build, build_causal_lm, tiny_llama_config, tiny_qwen3_config

from kvgate.cache import CacheError, CompressedCache, RaggedStore
from kvgate.cache.quant import KVQuant, Packed, dequantize, quantize
from kvgate.cache.rows import PlainRows, QuantRows
from kvgate.policies.base import Budget

# ------------------------------------------------------------------------------- the codec


def _rows(n: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows with an outlier channel, an offset, a constant row and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.05, 3.0, d) + 0.7
    x[:, 3] *= 25.0  # an outlier channel, as keys have
    x[0] = 1.25  # every group constant
    x[1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 16, 32, 64])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_within_half_a_step(bits, group, dtype):
    n, d, top = 300, 64, 2 ** bits - 1
    x = _rows(n, d, dtype, seed=bits + group)
    p = quantize(x, bits, group)
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (n, d * bits // 8)
    assert p.scale.dtype == p.zero.dtype == torch.float16
    assert p.scale.shape == p.zero.shape == (n, d // group)
    back = dequantize(p, dtype)
    assert back.dtype == dtype and back.shape == (n, d)
    xf = x.float().view(n, d // group, group)
    err = (back.float().view_as(xf) - xf).abs()
    scale = p.scale.float()[..., None]
    # the analytic bound: half the group's stored step, plus rounding into the output dtype
    # (half an ulp of the value given back) and fp32 arithmetic
    ulp = torch.finfo(dtype).eps
    given = torch.maximum(xf.abs(), back.float().view_as(xf).abs())
    bound = scale / 2 * (1 + 1e-5) + ulp / 2 * given * 1.01 + 1e-7
    assert (err <= bound).all(), (err - bound).max()
    # the stored step: the group's range over the levels, rounded up to fp16 (a few ulps, and
    # the zero point's rounding down, at most)
    rng = (xf.amax(-1) - xf.amin(-1))
    zero_ulp = p.zero.float().abs() * 2 ** -10 + 2 ** -24
    assert (p.scale.float() * top >= rng * (1 - 1e-6)).all()
    step = (rng + zero_ulp) / top * (1 + 2 ** -9) + 2 ** -24
    assert (p.scale.float()[rng > 0] <= step[rng > 0]).all()
    assert torch.equal(back[0].float(), torch.full((d,), 1.25))  # a constant group is exact
    assert torch.equal(back[1].float(), torch.zeros(d))


def test_four_bits_pack_two_codes_a_byte():
    x = torch.arange(16.0).repeat(3, 1)  # one group: codes 0..15 in order
    p = quantize(x, 4, 16)
    assert p.codes.shape == (3, 8) and p.codes[0].tolist() == [16 * (2 * i + 1) + 2 * i
                                                                for i in range(8)]
    assert torch.equal(dequantize(p, torch.float32), x)


@pytest.mark.parametrize("kwargs, message", [
    ({"bits": 3}, "kv_bits must be 16, 8 or 4, got 3"),
    ({"bits": True}, "kv_bits must be 16, 8 or 4"),
    ({"group": 0}, "kv_group must be an int >= 1, got 0"),
    ({"residual": -1}, "kv_residual must be an int >= 0, got -1"),
    ({"residual": 2.5}, "kv_residual must be an int >= 0, got 2.5"),
])
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(CacheError, match=message) as err:
        KVQuant(**kwargs)
    assert "\n" not in str(err.value)


def test_groups_must_split_the_heads():
    assert KVQuant(8, 64).group_for(16) == 16  # a head narrower than a group: one group
    with pytest.raises(CacheError, match="kv_group 12 does not split heads of 64 channels"):
        KVQuant(8, 12).group_for(64)
    with pytest.raises(CacheError, match="of an even size"):
        KVQuant(4, 3).group_for(15)
    model = build(tiny_llama_config())
    with pytest.raises(CacheError, match="kv_group 12 does not split heads of 16"):
        CompressedCache(model, NewestPolicy(), 0.5, kv_bits=8, kv_group=12)
    with pytest.raises(CacheError, match="kv_bits must be 16, 8 or 4, got 2"):
        CompressedCache(model, NewestPolicy(), 0.5, kv_bits=2)


# ------------------------------------------------------------------------------- the store


class _Reference:
    """Every key / value appended, by (sample, head, position)."""

    def __init__(self, b: int, h: int, d: int) -> None:
        self.k = torch.full((b, h, 0, d), float("nan"))
        self.v = self.k.clone()
        self.g = torch.Generator().manual_seed(5)

    def new(self, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, h, n, d = self.k.shape
        k = torch.randn(b, h, r, d, generator=self.g) * 2
        v = torch.randn(b, h, r, d, generator=self.g)
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        return k, v, torch.arange(n, n + r).expand(b, r)


def _check_window(store: RaggedStore, ref: _Reference, kv: KVQuant) -> int:
    """Every held entry: bit-equal inside the residual window (and in the tail), within one
    quantization step outside it. Returns how many entries were quantized."""
    keys, values = store.base_kv()
    if store.tail_len:
        keys = torch.cat([keys, store.tail_k], 2)
        values = torch.cat([values, store.tail_v], 2)
    pos = store.slot_positions()
    b, h, _ = torch.meshgrid(torch.arange(store.batch), torch.arange(store.kv_heads),
                             torch.arange(pos.shape[-1]), indexing="ij")
    real = pos >= 0
    want_k = ref.k[b[real], h[real], pos[real]]
    want_v = ref.v[b[real], h[real], pos[real]]
    got_k, got_v = keys[real], values[real]
    newest = ref.k.shape[2]
    recent = pos[real] >= newest - kv.residual
    assert torch.equal(got_k[recent], want_k[recent]) and torch.equal(got_v[recent],
                                                                      want_v[recent])
    old = ~recent
    for got, want in ((got_k[old], want_k[old]), (got_v[old], want_v[old])):
        g = want.view(want.shape[0], -1, kv.group)
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / (2 ** kv.bits - 1)
        assert ((got.view_as(g) - g).abs() <= step * 0.51 + 1e-6).all()
    return int(old.sum())


@pytest.mark.parametrize("bits", [8, 4])
def test_residual_window_is_bit_equal_through_every_move(bits):
    kv = KVQuant(bits, 8, residual=6)
    b, h, d = 2, 3, 16
    store, ref = RaggedStore(b, h, d, torch.float32, torch.device("cpu"), kv), _Reference(b, h, d)
    g = torch.Generator().manual_seed(0)
    store.append(*ref.new(20))
    store.rebuild(torch.rand(b, h, 20, generator=g) < 0.6)  # the prefill: ragged heads
    assert isinstance(store.rows, QuantRows) and not store.uniform
    quantized = _check_window(store, ref, kv)
    assert quantized > 0
    for step in range(40):  # decode: appends, holes, compactions
        store.append(*ref.new(1))
        keep = store.slot_valid() & (torch.rand(b, h, store.slots, generator=g) < 0.93)
        store.evict(keep)
        _check_window(store, ref, kv)
    twin = store.fork()  # a fork's writes never reach its source
    before = [t.clone() for t in store.rows.tensors()]
    twin.append(*ref.new(2))
    twin.rebuild(twin.slot_valid())
    assert all(torch.equal(a, c) for a, c in zip(before, store.rows.tensors()))
    _check_window(twin, ref, kv)


def test_in_place_replacement_keeps_the_window_exact():
    """A uniform base evicting as many entries as it appends writes over them in place."""
    kv = KVQuant(4, 8, residual=3)
    b, h, d = 1, 2, 8
    store, ref = RaggedStore(b, h, d, torch.float32, torch.device("cpu"), kv), _Reference(b, h, d)
    store.append(*ref.new(12))
    store.rebuild(store.slot_valid())
    twin = store.fork()
    for _ in range(6):
        twin.append(*ref.new(1))
        keep = twin.slot_valid()
        keep[:, :, 1] = False  # one base slot a step: the in-place path
        moves = twin.rebuild(keep)
        assert twin.uniform and moves.shape == (b * h, 12)
        _check_window(twin, ref, kv)
    assert twin.rows is not store.rows  # copied once before writing: the source is untouched
    assert _check_window(store, _prefix(ref, 12), kv) > 0


def _prefix(ref: _Reference, n: int) -> _Reference:
    out = _Reference(1, 1, 1)
    out.k, out.v = ref.k[:, :, :n], ref.v[:, :, :n]
    return out


def test_converting_a_full_precision_store_equals_quantizing_it_directly():
    kv = KVQuant(8, 8, residual=5)
    ref = _Reference(2, 2, 16)
    k, v, pos = ref.new(30)
    keep = torch.rand(2, 2, 30, generator=torch.Generator().manual_seed(1)) < 0.5
    direct = RaggedStore(2, 2, 16, torch.float32, torch.device("cpu"), kv)
    plain = RaggedStore(2, 2, 16, torch.float32, torch.device("cpu"))
    for s in (direct, plain):
        s.append(k, v, pos)
        s.rebuild(keep)
    converted = plain.converted(kv, torch.tensor([30, 30]))
    assert isinstance(plain.rows, PlainRows) and converted.kv == kv
    assert all(torch.equal(a, c) for a, c in zip(direct.rows.tensors(),
                                                 converted.rows.tensors()))
    assert torch.equal(direct.next_pos, converted.next_pos)
    with pytest.raises(ValueError, match="from full precision only"):
        converted.converted(KVQuant(4, 8), torch.tensor([30, 30]))


def _storage_bytes(store: RaggedStore) -> int:
    """The real storage behind every tensor the store references (its rows' included), each
    storage once; bookkeeping that is not stored data is left out: the cached gather index
    ``_index``, the ``holes`` marks and ``next_pos``."""
    seen, total = set(), 0

    def visit(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (PlainRows, QuantRows)):
            for name in obj.__slots__:
                visit(getattr(obj, name))
        elif isinstance(obj, Packed):
            visit(obj.codes), visit(obj.scale), visit(obj.zero)

    for name, value in vars(store).items():
        if name not in {"_index", "holes", "next_pos"}:
            visit(value)
    return total


# ------------------------------------------------------------------------------- the cache


def _model(family: str):
    if family == "llama":
        return build(tiny_llama_config(num_hidden_layers=3))
    return build_causal_lm(tiny_qwen3_config(num_hidden_layers=3))


def _run(model, cache, ids, steps, record):
    """Prefill ``ids``, then feed ``steps`` fixed tokens one at a time (the same tokens for every
    cache); ``record`` collects each attention call's output per forward."""
    forwards: list[list[torch.Tensor]] = []
    attend = cache.attend

    def recording(module, *args, **kwargs):
        out = attend(module, *args, **kwargs)
        forwards[-1].append(out[0])
        return out

    cache.attend = recording
    feed = torch.randint(1, 128, (ids.shape[0], steps), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        forwards.append([])
        model(ids, past_key_values=cache, use_cache=True)
        for i in range(steps):
            forwards.append([])
            model(feed[:, i:i + 1], past_key_values=cache, use_cache=True)
    record.extend(forwards)


# A decode step's attention output against the full-precision cache's (both evict the same
# entries, the same tokens are fed), relative: about one quantization step (1 / (2^bits - 1))
# at the first layer, whose inputs are the same in both runs, growing through the layers that
# read its output (the tiny models' attention is peaked: weights scaled up). Measured on these
# models with groups of 8: layer 0 up to 1.3 steps, any layer 3.2, the mean 1.9.
FIRST, ANY, MEAN = 2.0, 5.0, 2.5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [8, 4])
def test_attention_output_within_tolerance_of_the_full_precision_cache(family, bits):
    model = _model(family)
    ids = torch.randint(1, 128, (2, 80), generator=torch.Generator().manual_seed(2))
    full, quant = [], []
    ref = CompressedCache(model, NewestPolicy(), Budget(ratio=0.5))
    cache = CompressedCache(model, NewestPolicy(), Budget(ratio=0.5), kv_bits=bits,
                            kv_group=8, kv_residual=8)
    _run(model, ref, ids, 32, full)
    _run(model, cache, ids, 32, quant)
    # the prefill attends over the prompt as the model gave it: equal
    assert len(full[0]) == 3 and all(torch.equal(a, c) for a, c in zip(full[0], quant[0]))
    step = 1.0 / (2 ** bits - 1)
    errors = torch.tensor([[float((a - c).norm() / a.norm()) for a, c in zip(f, q)]
                           for f, q in zip(full[1:], quant[1:])])  # [32 steps, 3 layers]
    assert errors.shape == (32, 3) and (errors > 0).all()
    assert errors[:, 0].max() < FIRST * step, errors[:, 0].max() / step
    assert errors.max() < ANY * step and errors.mean() < MEAN * step, errors.max() / step
    for layer in range(3):  # eviction ran the same: at capacity, the same entries held
        assert torch.equal(cache.kept_counts(layer), ref.kept_counts(layer))
        assert torch.equal(cache.kept_counts(layer), cache.layers[layer].capacity)
        assert torch.equal(cache.layers[layer].store.slot_positions(),
                           ref.layers[layer].store.slot_positions())
    # the first layer's entries are the same tokens' in both runs: its residual window (the
    # newest 8 positions) reads back bit-equal to the full-precision cache's, older ones not
    got, want = _slots(cache.layers[0].store), _slots(ref.layers[0].store)
    pos = cache.layers[0].store.slot_positions()
    recent = pos >= cache.layers[0].real_seen[:, None, None] - 8
    old = (pos >= 0) & ~recent
    assert recent.any() and old.any()
    for a, c in zip(got, want):
        assert torch.equal(a[recent], c[recent]) and not torch.equal(a[old], c[old])


def _slots(store):
    """Keys and values over the slot view ``[B, H_kv, T, d]``: the base, then the tail."""
    keys, values = store.base_kv()
    if store.tail_len:
        keys, values = torch.cat([keys, store.tail_k], 2), torch.cat([values, store.tail_v], 2)
    return keys, values


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_bytes_held_is_the_real_storage(bits):
    model = build(tiny_llama_config())
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(model, NewestPolicy(), 0.5, kv_bits=bits, kv_group=8,
                            kv_residual=8)
    _run(model, cache, ids, 70, [])  # past a flush of the tail (TAIL_MAX)
    assert cache.bytes_held() == sum(_storage_bytes(layer.store) for layer in cache.layers)
    assert cache.bytes_held() == sum(layer.store.nbytes() for layer in cache.layers)
    if bits < 16:
        store = cache.layers[0].store
        rows = store.rows
        e, d = len(rows), store.head_dim
        codes = 2 * e * d * bits // 8  # keys and values
        scales = 2 * 2 * e * (d // 8) * 2  # a scale and a zero point, fp16, per group of 8
        exact = rows.exact.numel() * (8 + 2 * d * 4)  # row index and exact K/V, fp32
        assert rows.nbytes() == codes + scales + exact
        assert 0 < rows.exact.numel() <= 8 * 2 * store.kv_heads  # the window's rows only


def test_bytes_shrink_with_bits():
    model = build(tiny_llama_config())
    ids = torch.randint(1, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    held = {}
    for bits in (16, 8, 4):
        cache = CompressedCache(model, NewestPolicy(), 0.5, kv_bits=bits, kv_group=16,
                                kv_residual=4)
        _run(model, cache, ids, 1, [])
        held[bits] = cache.bytes_held()
    assert held[4] < held[8] < 0.5 * held[16]
