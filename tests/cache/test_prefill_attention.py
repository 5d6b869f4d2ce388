"""Eq. 5 prefill attention: the blocked path equals the brute-force formula."""

import pytest
import torch

from kvgate.cache import prefill
from kvgate.cache.prefill import eq5_attention, keep_masked_attention


def _brute(q, k, v, keep, valid, scaling, recent):
    """Eq. 5 written out: scores of every (row, key), masked, softmax, weighted sum."""
    _, h, n, _ = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    kp = keep.repeat_interleave(g, 1)
    j = torch.arange(n)[:, None]
    t = torch.arange(n)[None, :]
    near = (j - t < max(recent, 1)) & (t <= j)
    vis = (t <= j)[None, None] & valid[:, None, None, :] & (kp[:, :, None, :] | near)
    vis = vis | (j == t)[None, None]  # a padding row sees itself only
    s = (q @ kk.transpose(-1, -2)) * scaling
    s = s.masked_fill(~vis, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


def _inputs(b, h, hk, n, pad, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, 16, generator=gen)
    k = torch.randn(b, hk, n, 16, generator=gen)
    v = torch.randn(b, hk, n, 16, generator=gen)
    keep = torch.rand(b, hk, n, generator=gen) < 0.4
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[0, :pad] = False
    return q, k, v, keep, valid


@pytest.mark.parametrize("b,h,hk,n,recent,pad", [
    (1, 4, 4, 300, 0, 0),       # MHA, diagonal only, two blocks
    (2, 6, 2, 700, 128, 37),    # GQA, a band, left padding, three blocks
    (2, 4, 2, 520, 600, 90),    # a band longer than the prompt: everything visible
    (1, 6, 3, 257, 16, 0),      # a one-row last block
])
@pytest.mark.parametrize("fused", [True, False])
def test_blocked_matches_formula(b, h, hk, n, recent, pad, fused, monkeypatch):
    if not fused:  # the device-agnostic fallback of the log-sum-exp attention
        monkeypatch.setattr(prefill, "_FUSED_CPU", None)
    q, k, v, keep, valid = _inputs(b, h, hk, n, pad)
    want = _brute(q, k, v, keep, valid, 0.25, recent)
    got = keep_masked_attention(q, k, v, None, keep, 0.25, recent, valid=valid)
    assert got.shape == (b, n, h, 16)
    assert torch.isfinite(got).all()
    real = valid[:, :, None, None].expand_as(got)
    assert torch.allclose(got[real], want[real], atol=1e-5)


def test_heads_keeping_nothing_old():
    """A KV head that keeps no old key (its prefix is empty while others' is not)."""
    q, k, v, keep, valid = _inputs(1, 4, 2, 600, 0)
    keep[:, 0] = False
    want = _brute(q, k, v, keep, valid, 0.25, 8)
    got = keep_masked_attention(q, k, v, None, keep, 0.25, 8, valid=valid)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("whole", [[0], [1, 2], [0, 1, 2]])
def test_heads_that_keep_every_key_attend_apart(whole, monkeypatch):
    """A learned gate's per-head choice (some KV heads keep everything, the others little):
    those heads take one causal call, the rest the blocked path, and together they equal the
    formula, per head and batch row; the blocked path then sees only the other heads."""
    q, k, v, keep, valid = _inputs(2, 6, 3, 600, 0)
    keep[:, whole] = True
    seen = []
    blocked = prefill._blocked
    monkeypatch.setattr(prefill, "_blocked", lambda *a: seen.append(a[1].shape[1]) or blocked(*a))
    want = _brute(q, k, v, keep, valid, 0.25, 16)
    got = keep_masked_attention(q, k, v, None, keep, 0.25, 16, valid=valid)
    assert got.shape == (2, 600, 6, 16)
    assert torch.allclose(got, want, atol=1e-5)
    assert seen == ([3 - len(whole)] if len(whole) < 3 else [])
    keep[1, whole[0], 5] = False  # not whole in every row: the blocked path for all heads
    seen.clear()
    got = keep_masked_attention(q, k, v, None, keep, 0.25, 16, valid=valid)
    assert seen == [3 - (len(whole) - 1)]  # the heads still whole in both rows stay apart
    assert torch.allclose(got, _brute(q, k, v, keep, valid, 0.25, 16), atol=1e-5)


def test_general_path_matches_blocked():
    q, k, v, keep, valid = _inputs(2, 6, 3, 400, 50)
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & valid[:, None, :]
    general = keep_masked_attention(q, k, v, allowed, keep, 0.25, 32)
    blocked = keep_masked_attention(q, k, v, None, keep, 0.25, 32, valid=valid)
    real = valid[:, :, None, None].expand_as(general)
    assert torch.allclose(general[real], blocked[real], atol=1e-5)


def test_dispatch_reads_the_model_mask(monkeypatch):
    """eq5_attention takes the blocked path for causal + padding masks, the general one for
    anything else (a sliding window here), and both give the formula."""
    q, k, v, keep, valid = _inputs(2, 4, 2, 300, 20)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None] & valid[:, None, :]
    mask = torch.zeros(2, 1, n, n).masked_fill(~causal[:, None], float("-inf"))
    calls = []
    real_blocked = prefill._blocked
    monkeypatch.setattr(prefill, "_blocked", lambda *a: calls.append(1) or real_blocked(*a))
    got = eq5_attention(q, k, v, mask, valid, keep, 0.25, 16, None)
    assert calls == [1]
    want = _brute(q, k, v, keep, valid, 0.25, 16)
    real = valid[:, :, None, None].expand_as(got)
    assert torch.allclose(got[real], want[real], atol=1e-5)
    # a sliding window is not causal + padding: the general path, with the window applied
    j, t = torch.arange(n)[:, None], torch.arange(n)[None, :]
    windowed = causal & (j - t < 64)[None]
    wmask = torch.zeros(2, 1, n, n).masked_fill(~windowed[:, None], float("-inf"))
    got_w = eq5_attention(q, k, v, wmask, valid, keep, 0.25, 16, 64)
    assert calls == [1]
    assert not torch.allclose(got_w[real], want[real], atol=1e-3)
    far = (t <= j - 64)  # the same rows with old keys hidden: keep those keys out instead
    want_w = _brute(q, k, v, keep & ~far.any(0)[None, None], valid, 0.25, 16)
    assert torch.allclose(got_w[:, -1][valid[:, -1]], want_w[:, -1][valid[:, -1]], atol=1e-5)
