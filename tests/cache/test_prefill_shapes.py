"""The blocked eq. 5 prefill hands the fused attention kernel a bounded set of key lengths.

Why it matters: on a CPU with AMX, SDPA's fused kernel in bf16 keeps a oneDNN brgemm kernel per
distinct shape in a thread-local cache that is never emptied, so a dense prefix of arbitrary
length (the kept keys before each block of rows: another per layer, block and example) grew the
process's heap with every example of a gate's evaluation (``kvgate eval ruler ... --policies
local_gate``). The prefix is now padded to a multiple of ``prefill._PREFIX_STEP`` keys.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from kvgate.cache import prefill
from kvgate.cache.prefill import keep_masked_attention


def _prompt(seed: int, n: int, d: int = 16, dtype: torch.dtype = torch.float32):
    """A prompt of n tokens (1 row, 4 query heads, 2 KV heads) and a keep mask at its own
    rate, as different examples under a gate give."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, d, generator=gen).to(dtype) for heads in (4, 2, 2))
    rate = 0.05 + 0.9 * torch.rand((), generator=gen)
    keep = torch.rand(1, 2, n, generator=gen) < rate
    return q, k, v, keep


def test_key_lengths_do_not_grow_with_the_examples(monkeypatch):
    n, band = 1100, 16
    lengths = []
    attend = prefill._attend
    monkeypatch.setattr(prefill, "_attend",
                        lambda q, k, *a: lengths.append(k.shape[2]) or attend(q, k, *a))
    for seed in range(40):
        q, k, v, keep = _prompt(seed, n)
        keep_masked_attention(q, k, v, None, keep, 0.25, band)
    # 5 blocks of rows: three window widths (the first block's, the middle ones', the last's),
    # and a prefix per block after the first: at most one length per multiple of the step
    windows = {256, 256 + band - 1, n - 1024 + band - 1}
    assert len(set(lengths)) <= len(windows) + -(-n // 64), sorted(set(lengths))
    prefixes = set(lengths) - windows
    assert all(m % prefill._PREFIX_STEP == 0 for m in prefixes), sorted(prefixes)


def _heap_in_use() -> float:
    """Bytes glibc's malloc has handed out and not had back (mallinfo2), in MB."""

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc's mallinfo2")
def test_bf16_prefills_of_new_examples_hold_no_more_heap():
    """What the bound is for: once warm, more bf16 prefills with new keep masks hold no more
    native memory (before the padding, ~0.3 MB more per prompt on an AMX CPU; elsewhere the
    kernel caches nothing and this holds either way)."""
    run = [_prompt(seed, 1100, 64, torch.bfloat16) for seed in range(32)]
    for q, k, v, keep in run[:16]:
        keep_masked_attention(q, k, v, None, keep, 0.125, 16)
    before = _heap_in_use()
    for q, k, v, keep in run[16:]:
        keep_masked_attention(q, k, v, None, keep, 0.125, 16)
    assert _heap_in_use() - before < 1.0
