"""The Triton kernel (kernel="triton") against the chunked one, on the CPU under Triton's
interpreter: output and the four gradients (dq, dk, dv, the gate's) on random shapes with GQA,
left padding, recent band, one-shot prompts, queries after a prefix and masks of every kind.
Timings on CUDA are in bench/ (``gpu_checks.sh run OUT triton``), its CUDA tests in tests/gpu."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_mistral_config

from kvgate.attention.gated import gated_attention
from kvgate.gate import GateConfig, patch

triton_kernel = pytest.importorskip(
    "kvgate.attention.triton_kernel", reason="kernel 'triton' needs the triton package")
if not triton_kernel.triton_available():
    pytest.skip("kernel 'triton' needs the triton package (pip install 'kvgate[triton]')",
                allow_module_level=True)
# conftest.py turns the interpreter on for the CPU suite; tests/gpu runs the compiled kernels
assert triton_kernel.interpreting(), "the CPU tests of the triton kernel need TRITON_INTERPRET=1"


def _case(n, nq, per_query_head, seed=0, b=2, h=4, hk=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, n, d, generator=g).to(dtype) for _ in range(2))
    gate = (torch.rand(b, h if per_query_head else hk, n, generator=g) > 0.4).float()
    allowed = torch.ones(b, 1, nq, n, dtype=torch.bool)
    allowed[0, :, :, :3] = False  # left padding of sample 0
    return q, k, v, gate, allowed


def _prompt(n):
    prompt = torch.zeros(2, n, dtype=torch.bool)  # prompts of different lengths
    prompt[0, 3: n // 2], prompt[1, : n // 3] = True, True
    return prompt


def _run(kernel, q, k, v, gate, allowed, recent=0, prompt=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    gate = gate.clone().requires_grad_(True)
    out = gated_attention(q, k, v, gate, allowed, recent=recent, prompt=prompt, kernel=kernel)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, gate.grad


def _assert_same(got, want, atol, rtol):
    for name, a, b in zip(["out", "dq", "dk", "dv", "dgate"], got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("n,nq,recent,one_shot,per_query_head", [
    (37, 37, 0, False, False), (37, 37, 5, True, True), (70, 70, 5, False, True),
    (70, 70, 0, True, False), (70, 30, 5, False, False), (70, 30, 0, True, True),
])
def test_triton_kernel_gives_the_chunked_output_and_four_gradients(n, nq, recent, one_shot,
                                                                   per_query_head):
    q, k, v, gate, allowed = _case(n, nq, per_query_head)
    prompt = _prompt(n) if one_shot else None
    want = _run("chunked", q, k, v, gate, allowed, recent, prompt)
    got = _run("triton", q, k, v, gate, allowed, recent, prompt)
    _assert_same(got, want, atol=2e-5, rtol=1e-4)
    # evicted tokens get a gradient (a kept-only mask would give them zero)
    assert got[4][gate == 0].abs().sum() > 0


@pytest.mark.parametrize("mask", ["none", "window", "holes", "empty_rows"])
def test_every_kind_of_base_mask(mask):
    """None (causal), a sliding window with padding (contiguous runs per row: two vectors),
    a mask with holes and padding query rows that see nothing (the dense int8 path)."""
    n = 50
    q, k, v, gate, allowed = _case(n, n, per_query_head=False, seed=2)
    if mask == "none":
        allowed = None
    elif mask == "window":
        pos = torch.arange(n)
        allowed = allowed & ((pos[:, None] - pos[None, :]) < 12)
    elif mask == "holes":
        allowed[1, :, :, 7:9] = False
    else:
        allowed[0, :, :3, :] = False  # padding queries: only their own diagonal
    pb = triton_kernel._Problem(q, k, v, gate, allowed, None, 0.25, 3)
    assert pb.mode == {"none": triton_kernel._MASK_NONE, "window": triton_kernel._MASK_RUNS,
                       "holes": triton_kernel._MASK_DENSE,
                       "empty_rows": triton_kernel._MASK_RUNS}[mask]
    _assert_same(_run("triton", q, k, v, gate, allowed, 3),
                 _run("chunked", q, k, v, gate, allowed, 3), atol=2e-5, rtol=1e-4)


def test_a_group_of_eight_query_heads_and_head_width_not_a_power_of_two():
    q, k, v, gate, allowed = _case(40, 40, per_query_head=False, h=8, hk=1, d=24, seed=4)
    _assert_same(_run("triton", q, k, v, gate, allowed, 2),
                 _run("chunked", q, k, v, gate, allowed, 2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,nq,recent,per_query_head", [(70, 70, 5, True), (81, 40, 3, False)])
def test_an_unpadded_causal_mask_is_read_as_no_mask(n, nq, recent, per_query_head):
    """The causal mask transformers builds for an unpadded batch needs no mask vectors: the
    kernels take it as no mask (queries after a prefix too) and give the chunked results."""
    q, k, v, gate, _ = _case(n, nq, per_query_head, seed=8)
    pos = torch.arange(n)
    causal = (pos[None, :] <= pos[n - nq:, None]).expand(2, 1, nq, n)
    assert triton_kernel._Problem(q, k, v, gate, causal, None, 0.25, recent).mode == \
        triton_kernel._MASK_NONE
    _assert_same(_run("triton", q, k, v, gate, causal, recent),
                 _run("chunked", q, k, v, gate, causal, recent), atol=2e-5, rtol=1e-4)


def test_half_precision_tiles_stay_within_their_rounding_of_the_chunked_kernel():
    """fp16 operands in the tiles, fp32 statistics: every output and gradient within fp16's
    rounding of the chunked kernel (which computes in fp32), relative to its scale. (bf16 is
    checked on CUDA, tests/gpu: Triton 3.9's interpreter multiplies bf16 tiles wrongly.)"""
    dtype, tol = torch.float16, 4e-3
    q, k, v, gate, allowed = _case(60, 60, per_query_head=False, dtype=dtype, seed=5)
    want = _run("chunked", q, k, v, gate, allowed, 4, _prompt(60))
    got = _run("triton", q, k, v, gate, allowed, 4, _prompt(60))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dgate"], got, want):
        assert a.dtype == b.dtype, name
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_the_exp_clamp_bounds_an_evicted_keys_gradient_as_the_chunked_kernel_does():
    """An evicted key that outscores every kept one: P~ = exp(s - lse) is clamped at
    exp(EXP_CLAMP) in both kernels, so their gate gradients agree and stay finite."""
    q, k, v, gate, allowed = _case(30, 30, per_query_head=False, seed=6)
    k[:, :, 5] = q[:, ::2, 20:].mean(2) * 40  # a key every later query scores far above the rest
    gate[:, :, 5] = 0.0
    got = _run("triton", q, k, v, gate, allowed)
    want = _run("chunked", q, k, v, gate, allowed)
    assert torch.isfinite(got[4]).all() and got[4][:, :, 5].abs().max() > 0
    torch.testing.assert_close(got[4], want[4], atol=1e-3, rtol=1e-4)


def test_forward_without_autograd_equals_the_chunked_kernel():
    q, k, v, gate, allowed = _case(45, 20, per_query_head=True, seed=7)
    with torch.no_grad():
        got = gated_attention(q, k, v, gate, allowed, recent=3, kernel="triton")
        want = gated_attention(q, k, v, gate, allowed, recent=3, kernel="chunked")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama_config, tiny_mistral_config])
@pytest.mark.parametrize("prefill", ["gated", "full"])
def test_a_gated_model_on_the_triton_kernel_gives_the_same_logits_and_gate_gradients(make,
                                                                                    prefill):
    """Through the patched layers (GateConfig.kernel), padding, sinks and Mistral's window."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :4] = 0
    results = {}
    for kernel in ("chunked", "triton"):
        torch.manual_seed(0)
        model = build(make(sliding_window=10) if make is tiny_mistral_config else make())
        patch(model, GateConfig(recent=4, sinks=2, prefill=prefill, kernel=kernel, gamma=0.0))
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[mask.bool()].square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if "kv_gate" in n}
        results[kernel] = logits.detach(), grads
    real = mask.bool()
    (want, want_grads), (got, got_grads) = results["chunked"], results["triton"]
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-3)


def test_operands_in_the_layers_layout_are_read_in_place_and_gradients_keep_it():
    """q, k, v as attention layers hand them ([B, H, n, d] views of [B, n, H, d] projections)
    and dO as the layer's transpose back gives it: the kernels read them through their strides
    (no copy), write the output in [B, n, H, d] memory (the transpose back is free), return each
    gradient in its input's layout, and give the chunked kernel's values."""
    q, k, v, gate, allowed = _case(40, 40, per_query_head=False, seed=3)
    want = _run("chunked", q, k, v, gate, allowed, recent=4)

    def layers_layout(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)

    q, k, v = (layers_layout(t) for t in (q, k, v))
    assert not q.is_contiguous()
    g = gate.clone().requires_grad_(True)
    out = gated_attention(q, k, v, g, allowed, recent=4, kernel="triton")
    problem = out.grad_fn.problem
    assert [t.data_ptr() for t in (problem.q, problem.k, problem.v)] == [
        t.data_ptr() for t in (q, k, v)]
    assert out.transpose(1, 2).is_contiguous()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    # dO arrives as the layer hands it back: a [B, H, n, d] view of [B, n, H, d] memory
    (out.transpose(1, 2).contiguous().float() * weights.transpose(1, 2)).sum().backward()
    for t in (q, k, v):
        assert t.grad.stride() == t.stride()
    _assert_same((out.detach(), q.grad, k.grad, v.grad, g.grad), want, atol=2e-5, rtol=1e-4)


def test_the_first_tile_config_of_each_kernel_spills_nothing_and_runs_warpgroup_mma_on_an_h100():
    """What an untuned launch runs (KVGATE_TRITON_AUTOTUNE=0, the GPU checks' first pass),
    compiled for sm_90 as a training step launches it at head widths 128 and 64, by
    bench/triton_resources.py (triton's own ptxas, no GPU): a spilling config runs its inner
    loop through local memory (every former key-tile candidate did at width 128), and a dot
    with fewer than 64 rows a warpgroup falls back from Hopper's warpgroup MMA to mma.sync (two
    of the key-tile kernel's four did while its tiles were [queries, keys])."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(root / "bench" / "triton_resources.py"), "--first",
                          "--shapes", "1,4,4,256,128", "1,6,2,256,64"],
                         check=False, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if "candidate" in line]
    assert len(rows) == 6, run.stdout
    assert not [row for row in rows if "SPILLS" in row or "MMA" in row], run.stdout


def test_off_cuda_without_the_interpreter_the_kernel_is_refused_by_name(monkeypatch):
    q, k, v, gate, _ = _case(20, 20, per_query_head=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="triton attention kernel runs on CUDA"):
        gated_attention(q, k, v, gate, kernel="triton")
    assert GateConfig(kernel="triton").kernel == "triton"


def test_a_padded_forward_derives_the_kernels_mask_vectors_once_not_per_layer(monkeypatch):
    """Every layer gets the same mask tensor, and reducing it to the kernels' vectors reads
    back from the device: the first gated layer derives them, the others reuse them; a new
    forward (a new mask) derives them again."""
    derived = []
    real = triton_kernel._mask_vectors

    def counting(allowed, n, device):
        derived.append(n)
        return real(allowed, n, device)

    monkeypatch.setattr(triton_kernel, "_mask_vectors", counting)
    model = build(tiny_llama_config(num_hidden_layers=3))
    patch(model, GateConfig(kernel="triton"))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        assert derived == [12]
        model(input_ids=ids[:, 2:], attention_mask=mask[:, 2:])
    assert derived == [12, 10]
