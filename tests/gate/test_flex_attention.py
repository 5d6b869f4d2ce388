"""The FlexAttention kernel (kernel="flex") against the chunked one, on the CPU: forward and the
gate's gradient (both are flex *forwards*, which run here); dq, dk, dv come from FlexAttention's
own backward, which needs CUDA (tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_mistral_config

from kvgate.attention.gated import choose_kernel, gated_attention
from kvgate.gate import GateConfig, patch
from kvgate.gate.config import ConfigError

# eager flex_attention on the CPU warns that it is the slow reference path: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def _case(n: int, nq: int, per_query_head: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, hk, d = 2, 4, 2, 16
    q = torch.randn(b, h, nq, d, generator=g)
    k, v = (torch.randn(b, hk, n, d, generator=g) for _ in range(2))
    gate = (torch.rand(b, h if per_query_head else hk, n, generator=g) > 0.4).float()
    allowed = torch.ones(b, 1, nq, n, dtype=torch.bool)
    allowed[0, :, :, :3] = False  # left padding of sample 0
    return q, k, v, gate, allowed


def _out_and_gate_grad(kernel, q, k, v, gate, allowed, recent, prompt):
    gate = gate.clone().requires_grad_(True)
    out = gated_attention(q, k, v, gate, allowed, recent=recent, prompt=prompt, kernel=kernel)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), gate.grad


@pytest.mark.parametrize("n,nq,recent,one_shot,per_query_head", [
    (37, 37, 0, False, False), (37, 37, 5, True, True), (150, 150, 5, False, True),
    (150, 150, 0, True, False), (150, 60, 5, False, False), (150, 60, 0, True, True),
    (150, 60, 5, True, False),  # nq 60: queries after an encoded prefix (one-shot's 2nd pass)
])
def test_flex_kernel_gives_the_chunked_output_and_gate_gradient(n, nq, recent, one_shot,
                                                                per_query_head):
    q, k, v, gate, allowed = _case(n, nq, per_query_head)
    prompt = None
    if one_shot:  # prompts of different lengths (GateConfig.prefill="full")
        prompt = torch.zeros(2, n, dtype=torch.bool)
        prompt[0, 3: n // 2], prompt[1, : n // 3] = True, True
    want, want_grad = _out_and_gate_grad("chunked", q, k, v, gate, allowed, recent, prompt)
    got, got_grad = _out_and_gate_grad("flex", q, k, v, gate, allowed, recent, prompt)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-4, rtol=1e-4)
    # evicted tokens get a gradient: the transposed pass covers the keys the forward hid
    assert got_grad[gate == 0].abs().sum() > 0


def test_a_bf16_gate_gets_a_bf16_gradient_equal_to_the_chunked_kernels():
    q, k, v, gate, allowed = _case(40, 40, per_query_head=False)
    grads = {}
    for kernel in ("chunked", "flex"):
        flags = gate.to(torch.bfloat16).requires_grad_(True)
        gated_attention(q, k, v, flags, allowed, recent=3, kernel=kernel).sum().backward()
        grads[kernel] = flags.grad
    assert grads["flex"].dtype == torch.bfloat16
    torch.testing.assert_close(grads["flex"], grads["chunked"])


def test_half_precision_tiles_stay_within_bf16_error_of_the_fp32_kernel():
    """compute_dtype=bf16 (what bench_kernel times beside fp32): output and gate gradient
    within bf16's rounding of the chunked kernel's, returned in the inputs' dtype."""
    from kvgate.attention.flex import flex_gated_attention

    q, k, v, gate, allowed = _case(150, 150, per_query_head=False)
    want, want_grad = _out_and_gate_grad("chunked", q, k, v, gate, allowed, 5, None)
    flags = gate.clone().requires_grad_(True)
    got = flex_gated_attention(q, k, v, flags, allowed, recent=5, compute_dtype=torch.bfloat16)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * weights).sum().backward()
    assert got.dtype == torch.float32
    for a, b in ((got.detach(), want), (flags.grad, want_grad)):
        err = float((a - b).abs().max() / b.abs().max())
        assert 0 < err < 2e-2  # rounded (not the fp32 path), but only by bf16's precision


def test_a_key_no_query_is_gated_on_gets_zero_gradient_not_nan():
    # everything within the recent band: the transposed pass has only empty rows
    q, k, v, gate, _ = _case(8, 8, per_query_head=False)
    _, grad = _out_and_gate_grad("flex", q, k, v, gate, None, recent=8, prompt=None)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_training_q_k_v_through_flex_on_the_cpu_is_refused_by_name():
    q, k, v, gate, _ = _case(20, 20, per_query_head=False)
    with pytest.raises(RuntimeError, match="flex attention kernel trains only on CUDA"):
        gated_attention(q.requires_grad_(True), k, v, gate, kernel="flex")


def test_unknown_kernel_is_refused_by_name():
    q, k, v, gate, _ = _case(20, 20, per_query_head=False)
    with pytest.raises(ValueError, match="unknown attention kernel 'cutlass'"):
        gated_attention(q, k, v, gate, kernel="cutlass")
    with pytest.raises(ConfigError, match="GateConfig.kernel"):
        GateConfig(kernel="cutlass")


def test_auto_picks_the_chunked_kernel_on_the_cpu_and_fp32_and_triton_for_half_on_cuda(monkeypatch):
    import importlib.util

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_kernel("auto", cpu, torch.bfloat16) == "chunked"
    assert choose_kernel("flex", cpu, torch.float32) == "flex"
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


@pytest.mark.parametrize("make", [tiny_llama_config, tiny_mistral_config])
@pytest.mark.parametrize("prefill", ["gated", "full"])
def test_a_gated_model_on_the_flex_kernel_gives_the_same_logits(make, prefill):
    """Through the patched layers (GateConfig.kernel), padding and Mistral's window included."""
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :4] = 0
    logits = {}
    for kernel in ("chunked", "flex"):
        model = build(make())
        patch(model, GateConfig(recent=4, sinks=2, prefill=prefill, kernel=kernel))
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits["flex"][real], logits["chunked"][real], atol=2e-5, rtol=1e-4)


def test_the_mods_trace_in_one_graph_and_new_closures_do_not_recompile(monkeypatch):
    """On CUDA flex_attention is compiled, and each call builds new mask/score closures: they
    must trace without a graph break (fullgraph) and hit the cache at the same shape, with one
    dynamic recompile for a new length, not one per step. Traced here with dynamo's eager
    backend (the CPU's inductor has no lse output for flex)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kvgate.attention import flex

    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(flex.flex_attention, backend="eager", fullgraph=True)
    monkeypatch.setattr(flex, "_flex_fn", lambda device: traced)
    graphs = []
    for seed, n in enumerate([60, 60, 60, 90, 120, 60]):
        q, k, v, gate, allowed = _case(n, n, per_query_head=False, seed=seed)
        _, grad = _out_and_gate_grad("flex", q, k, v, gate, allowed, 5, None)
        _, want = _out_and_gate_grad("chunked", q, k, v, gate, allowed, 5, None)
        torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    # two graphs (forward, transposed gate pass) per static shape, then once more dynamic
    assert graphs == [2, 2, 2, 4, 4, 4]
