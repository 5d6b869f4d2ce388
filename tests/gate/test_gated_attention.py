"""Gated attention (eq. 5): mask semantics, exact forward, gradient reaching evicted tokens."""

import math

import pytest
import torch

from kvgate.attention.gated import gated_attention, gated_attention_reference


def _qkv(b=2, h=4, hk=2, n=23, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, n, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, n, d, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


def test_hand_made_mask_semantics():
    # one head, 4 tokens, token 1 evicted: value rows are one-hot so the output shows
    # exactly which keys each query saw (with equal scores -> uniform over visible keys)
    n = 4
    q = torch.zeros(1, 1, n, 4)
    k = torch.zeros(1, 1, n, 4)
    v = torch.eye(n).view(1, 1, n, n)
    gate = torch.tensor([[[1.0, 0.0, 1.0, 1.0]]])
    out = gated_attention(q, k, v, gate)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0],          # query 0 sees itself
        [1 / 2, 1 / 2, 0, 0],  # query 1 sees key 0 and itself (diagonal always visible)
        [1 / 2, 0, 1 / 2, 0],  # evicted key 1 invisible to later queries
        [1 / 3, 0, 1 / 3, 1 / 3],
    ])
    torch.testing.assert_close(out, expected)


def test_causal_order_kept_even_when_everything_kept():
    q, k, v = _qkv(b=1, h=1, hk=1, n=6)
    gate = torch.ones(1, 1, 6, dtype=torch.float64)
    out = gated_attention(q, k, v, gate)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("per_query_head", [False, True])
@pytest.mark.parametrize("recent", [0, 3])
@pytest.mark.parametrize("one_shot", [False, True])
def test_forward_and_all_gradients_match_materialised_formula(per_query_head, recent, one_shot):
    q, k, v = _qkv()
    b, h, n, _ = q.shape
    hg = h if per_query_head else k.shape[1]
    gate = (torch.rand(b, hg, n, generator=torch.Generator().manual_seed(1)) > 0.5).double()
    gate.requires_grad_(True)
    allowed = torch.ones(b, 1, n, n, dtype=torch.bool)
    allowed[0, :, :, :5] = False  # left padding of sample 0
    prompt = None
    if one_shot:  # prompts of different lengths, the chunk boundary inside one of them
        prompt = torch.zeros(b, n, dtype=torch.bool)
        prompt[0, 5:16], prompt[1, :12] = True, True
    out = gated_attention(q, k, v, gate, allowed, recent=recent, chunk=7, prompt=prompt)
    ref = gated_attention_reference(q, k, v, gate, allowed, recent=recent, prompt=prompt)
    real = torch.ones(b, n, dtype=torch.bool)
    real[0, :5] = False
    torch.testing.assert_close(out[:, :, :][real[:, None, :, None].expand_as(out)],
                               ref[real[:, None, :, None].expand_as(ref)], atol=1e-6, rtol=1e-5)
    w = torch.randn_like(out) * real[:, None, :, None]
    g1 = torch.autograd.grad((out * w).sum(), [q, k, v, gate])
    g2 = torch.autograd.grad((ref * w).sum(), [q, k, v, gate])
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)


def test_one_shot_prompt_rows_attend_fully_and_only_later_rows_are_gated():
    """With a prompt mask the prompt is encoded as with full attention whatever the flags, and
    the tokens after it see the kept prompt tokens plus every earlier token after the prompt."""
    n, p = 6, 3
    q, k = torch.zeros(1, 1, n, n), torch.zeros(1, 1, n, n)
    v = torch.eye(n).view(1, 1, n, n)
    gate = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0, 1.0]]])  # prompt token 1, 2 and 3, 4 "evicted"
    prompt = torch.tensor([[True] * p + [False] * (n - p)])
    out = gated_attention(q, k, v, gate, prompt=prompt)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1 / 2, 1 / 2, 0, 0, 0, 0],          # prompt rows: full causal attention
        [1 / 3, 1 / 3, 1 / 3, 0, 0, 0],
        [1 / 2, 0, 0, 1 / 2, 0, 0],          # after the prompt: kept prompt token 0 + itself
        [1 / 3, 0, 0, 1 / 3, 1 / 3, 0],      # tokens after the prompt are never evicted
        [1 / 4, 0, 0, 1 / 4, 1 / 4, 1 / 4],
    ])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="prompt shape"):
        gated_attention(q, k, v, gate, prompt=prompt[:, :4])


def test_spec_worked_example_gradient_to_evicted_token():
    # one row: logits [0,0,0], g = [1, 0, 1] (last = diagonal), values [1, 5, 3], L = o
    # dL/dg_1 = (1/2) * (5 - 2) = 1.5 (first-order effect of re-admitting the token)
    q = torch.zeros(1, 1, 3, 1)
    k = torch.zeros(1, 1, 3, 1)
    v = torch.tensor([1.0, 5.0, 3.0]).view(1, 1, 3, 1)
    gate = torch.tensor([[[1.0, 0.0, 1.0]]], requires_grad=True)
    out = gated_attention(q, k, v, gate)
    out[0, 0, 2, 0].backward()
    assert out[0, 0, 2, 0].item() == pytest.approx(2.0)
    assert gate.grad[0, 0, 1].item() == pytest.approx(1.5)


def test_evicted_gate_gradient_matches_finite_difference_of_relaxation():
    q, k, v = _qkv(b=1, h=2, hk=1, n=9)
    gate = torch.ones(1, 1, 9, dtype=torch.float64)
    gate[0, 0, [1, 4, 6]] = 0.0
    gate.requires_grad_(True)
    w = torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (gated_attention(q, k, v, gate) * w).sum().backward()

    def relaxed(gv):  # multiplicative gated softmax, continuous in g
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        causal = torch.ones(9, 9, dtype=torch.bool).tril()
        eye = torch.eye(9, dtype=torch.bool)
        gm = torch.where(eye, torch.ones(9, 9, dtype=torch.float64), gv[0, 0][None, :].expand(9, 9))
        e = torch.exp(s) * gm * causal
        return ((e / e.sum(-1, keepdim=True)) @ v * w).sum()

    eps = 1e-6
    for t in [1, 4, 6, 2]:  # evicted and kept
        plus, minus = gate.detach().clone(), gate.detach().clone()
        plus[0, 0, t] += eps
        minus[0, 0, t] -= eps
        fd = (relaxed(plus) - relaxed(minus)) / (2 * eps)
        assert gate.grad[0, 0, t].item() == pytest.approx(fd.item(), rel=1e-4, abs=1e-6)
    assert gate.grad[0, 0, [1, 4, 6]].abs().min() > 0


def test_no_nan_with_extreme_scores_and_fully_evicted_rows():
    q, k, v = _qkv(b=1, h=2, hk=2, n=12, dtype=torch.float32)
    with torch.no_grad():
        q.mul_(300.0)  # extreme logits
    gate = torch.zeros(1, 2, 12, requires_grad=True)  # everything evicted: only diagonals remain
    out = gated_attention(q, k, v, gate)
    out.square().sum().backward()
    assert torch.isfinite(out).all()
    for t in (q.grad, k.grad, v.grad, gate.grad):
        assert torch.isfinite(t).all()
    assert gate.grad.abs().sum() > 0
    # with every key evicted each query sees only itself: output = its own value
    torch.testing.assert_close(out, v.detach())


def test_gqa_flag_broadcast_to_its_query_heads():
    q, k, v = _qkv(b=1, h=4, hk=2, n=10)
    gate = torch.ones(1, 2, 10, dtype=torch.float64)
    gate[0, 0, 3] = 0.0  # evict token 3 from KV head 0 only
    out = gated_attention(q, k, v, gate)
    per_q = gate.repeat_interleave(2, 1)  # the same decision per query head
    torch.testing.assert_close(out, gated_attention(q, k, v, per_q))
    full = gated_attention(q, k, v, torch.ones_like(gate))
    # query heads 0,1 (KV head 0) change after token 3; heads 2,3 (KV head 1) do not
    assert (out[0, :2, 4:] - full[0, :2, 4:]).abs().max() > 1e-4
    torch.testing.assert_close(out[0, 2:], full[0, 2:])


def test_bench_stand_in_takes_every_argument_of_the_kernel():
    """bench/bench_train.py swaps the kernel for the materialised formula: it must accept all
    that the gated layers pass, and compute the same attention."""
    import inspect

    from conftest import load_script

    bench = load_script("bench/bench_train.py")
    assert (list(inspect.signature(bench.materialised).parameters)
            == list(inspect.signature(gated_attention).parameters))
    q, k, v = _qkv(b=1, n=10)
    gate = (torch.rand(1, 2, 10, generator=torch.Generator().manual_seed(2)) > 0.5).double()
    prompt = torch.tensor([[True] * 6 + [False] * 4])
    torch.testing.assert_close(bench.materialised(q, k, v, gate, recent=2, prompt=prompt),
                               gated_attention(q, k, v, gate, recent=2, prompt=prompt),
                               atol=1e-6, rtol=1e-5)  # both fp32 inside


@pytest.mark.parametrize("one_shot", [False, True])
def test_queries_over_a_longer_prefix_are_the_last_rows_of_the_full_problem(one_shot):
    """q shorter than k (a continuation over an encoded prefix): output and every gradient are
    those of the same rows in the square problem, with chunks not aligned to the prefix."""
    q, k, v = _qkv(n=23)
    b, h, n, _ = q.shape
    tail = 9
    gate = (torch.rand(b, k.shape[1], n, generator=torch.Generator().manual_seed(2)) > 0.5)
    gate = gate.double().requires_grad_(True)
    prompt = None
    if one_shot:
        prompt = torch.zeros(b, n, dtype=torch.bool)
        prompt[:, : n - tail] = True
    grad = torch.randn(b, h, tail, q.shape[-1], dtype=q.dtype,
                       generator=torch.Generator().manual_seed(3))

    def run(rows_from: int):
        qs = q.detach()[:, :, rows_from:].clone().requires_grad_(True)
        ks, vs = k.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)
        gs = gate.detach().clone().requires_grad_(True)
        out = gated_attention(qs, ks, vs, gs, recent=2, chunk=4, prompt=prompt)
        out[:, :, -tail:].backward(grad)
        return out[:, :, -tail:], qs.grad[:, :, -tail:], ks.grad, vs.grad, gs.grad

    rect, square = run(n - tail), run(0)
    for got, want in zip(rect, square):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)  # fp32 inside
    assert square[4].abs().sum() > 0  # the gate really receives a gradient


def test_more_queries_than_keys_is_refused():
    q, k, v = _qkv(n=6)
    with pytest.raises(ValueError, match="last rows"):
        gated_attention(torch.cat([q, q], 2), k, v, torch.ones(2, 2, 6, dtype=q.dtype))


@pytest.mark.parametrize("tail", [None, 70])
def test_cpu_forward_reads_only_the_keys_each_row_chunk_can_reach(tail, monkeypatch):
    """On the CPU the fused kernel runs per chunk of query rows over the keys up to the chunk's
    last row (under one n x n mask it would also compute the unreachable upper triangle), and
    the stitched output is the whole problem's."""
    from kvgate.attention import gated

    q, k, v = _qkv(b=1, h=2, hk=1, n=150, dtype=torch.float32)
    q = q.detach()[:, :, -tail:] if tail else q.detach()
    gate = (torch.rand(1, 1, 150, generator=torch.Generator().manual_seed(4)) > 0.5).float()
    whole = gated_attention(q, k.detach(), v.detach(), gate, chunk=150)
    calls = []
    kernel = gated._masked_forward

    def spy(q_, k_, v_, bias, scaling):
        calls.append((q_.shape[2], k_.shape[2], tuple(bias.shape[-2:])))
        return kernel(q_, k_, v_, bias, scaling)

    monkeypatch.setattr(gated, "_masked_forward", spy)
    out = gated_attention(q, k.detach(), v.detach(), gate)  # default chunking
    nq, offset = q.shape[2], 150 - q.shape[2]
    step = calls[0][0]
    assert len(calls) == -(-nq // step) > 1
    for i, (rows, keys, bias) in enumerate(calls):
        assert keys == offset + min((i + 1) * step, nq) and bias == (rows, keys)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-5)


def test_row_chunks_are_small_on_the_cpu_and_large_on_a_gpu():
    """On the CPU 64-row chunks skip the unreachable triangle; on a GPU every chunk costs a
    round of kernel launches, so a chunk holds up to 256 MB of fp32 scores (the whole problem
    when that fits) and never fewer than 256 rows, and no chunk is longer than the sequence."""
    from kvgate.attention.gated import _rows_per_chunk

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # only the device type is read
    assert _rows_per_chunk(9, 2048, None, cpu) == 64
    assert _rows_per_chunk(9, 100_000, None, cpu) == 16  # 16 MB cap, 16-row floor
    assert _rows_per_chunk(9, 2048, None, gpu) == 2048  # 151 MB: one chunk
    assert _rows_per_chunk(32, 2048, None, gpu) == 1024  # 256 MB per chunk
    assert _rows_per_chunk(32, 32768, None, gpu) == 256  # the floor
    assert _rows_per_chunk(9, 100, None, gpu) == 100
    assert _rows_per_chunk(9, 2048, 96, gpu) == 96  # an explicit chunk wins


def test_an_unknown_or_removed_kernel_is_refused_in_one_line_naming_the_choice():
    from kvgate.attention.kernels import KERNELS, KernelError
    from kvgate.errors import KVGateError

    q, k, v = _qkv()
    gate = torch.ones(2, 2, 23, dtype=torch.float64)
    with pytest.raises(KernelError, match=r"kernel: must be one of .*'cutlass'") as err:
        gated_attention(q, k, v, gate, kernel="cutlass")
    assert isinstance(err.value, KVGateError) and "\n" not in str(err.value)
    # the FlexAttention kernel is gone: asking for it names what replaced it
    assert "flex" not in KERNELS
    with pytest.raises(KernelError, match="'flex': .*removed.*use chunked, or triton on CUDA"):
        gated_attention(q, k, v, gate, kernel="flex")


def test_auto_picks_the_chunked_kernel_on_the_cpu_and_fp32_and_triton_for_half_on_cuda(monkeypatch):
    import importlib.util

    from kvgate.attention.gated import choose_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_kernel("auto", cpu, torch.bfloat16) == "chunked"
    assert choose_kernel("chunked", cpu, torch.float32) == "chunked"
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else found(name, *a))
    assert choose_kernel("auto", cuda, torch.bfloat16) == "triton"
    assert choose_kernel("auto", cuda, torch.float16) == "triton"
    # fp32 tiles multiply exactly, off the tensor cores: slower than the chunked kernel
    assert choose_kernel("auto", cuda, torch.float32) == "chunked"
    assert choose_kernel("triton", cuda, torch.float32) == "triton"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else found(name, *a))
    assert choose_kernel("auto", cuda, torch.bfloat16) == "chunked"
