"""Kept keys and values in 8 or 4 bits: the settings (``KVQuant``) and the codec.

A row ``[d]`` (one token's key or value in one KV head) is cut into groups of ``group``
consecutive channels; each group stores an fp16 zero point (its minimum, rounded down) and an
fp16 scale (its range over ``2**bits - 1``, rounded up), and every channel the nearest level
``round((x - zero) / scale)`` as an unsigned code: one byte at 8 bits, two codes a byte at 4
bits. Rounding zero down and scale up keeps the group's range on the grid, so a value comes
back within half its group's stored scale (``dequantize``; the test checks this bound).

Why per token, for keys too (KIVI, arXiv:2402.02750, groups keys along tokens per channel):
the ragged store moves single entries (a decode-time eviction writes a new entry over an
evicted one in place, a compaction gathers the survivors, a fork shares rows, heads hold
different tokens), so a row must decode alone; a key group spanning tokens would tie entries
that eviction separates. Measured as good (``bench/bench_kv_quant.py --grouping``: SmolLM2-135M,
a 1k RULER context under SnapKV at 50%, every stored entry quantized in groups of 32, the
question and answer fed over it): the next-token KL to the 16-bit cache is 2.2e-5 per token
against 3.7e-5 per channel at 8 bits, 1.1e-2 against 1.0e-2 at 4 bits.

Why written here rather than taken from a library: torch's per-channel quantized tensors (torch
2.13, deprecated) store a float64 scale and an int64 zero point per group (16 bytes, more than
the 4-bit codes of a 32-channel group), refuse row gathers and scatters, and have no 4-bit type
per channel; transformers' ``QuantizedCache`` backends (quanto, HQQ) quantize a dense
``[B, H, T, d]`` layer cache, dequantizing and re-quantizing all of it each time its residual
fills, which a ragged store of different tokens per head is not. The packing is two shifts and
a mask. On
CUDA, a fused dequantize-attention kernel (reading the codes inside the attention instead of
materialising the dequantized base each step) is the GPU path; it is left for a CUDA machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvgate.cache.errors import CacheError

BITS = (16, 8, 4)
_FP16_MAX = 65504.0


def _int_at_least(value: object, name: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CacheError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class KVQuant:
    """How a ``CompressedCache`` stores its kept entries.

    Args:
        bits: 16 (as the model gives them, no quantization), 8 or 4.
        group: channels per scale and zero point (a head with fewer channels is one group).
        residual: the newest tokens (by position) held in full precision besides their codes;
            an entry is quantized for good when it leaves this window (at the next compaction
            of its store: ``kvgate.cache.ragged``). The tokens appended since the last
            compaction (at most ``ragged.TAIL_MAX``) are full precision whatever this is.
    """

    bits: int = 16
    group: int = 32
    residual: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise CacheError(f"kv_bits must be 16, 8 or 4, got {self.bits!r}")
        _int_at_least(self.group, "kv_group", 1)
        _int_at_least(self.residual, "kv_residual", 0)

    @classmethod
    def from_flags(cls, bits: int, group: int, residual: int) -> KVQuant:
        """From command-line flags: a refusal names ``--kv-bits`` / ``--kv-group`` /
        ``--kv-residual`` instead of the keyword arguments."""
        try:
            return cls(bits, group, residual)
        except CacheError as exc:
            raise CacheError(str(exc).replace("kv_", "--kv-")) from None

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def group_for(self, head_dim: int) -> int:
        """The group size for heads of ``head_dim`` channels (one line if it does not fit)."""
        group = min(self.group, head_dim)
        if head_dim % group or (self.bits == 4 and group % 2):
            raise CacheError(f"kv_group {self.group} does not split heads of {head_dim} "
                             f"channels into equal groups" + (" of an even size"
                                                              if self.bits == 4 else ""))
        return group

    def kwargs(self) -> dict[str, int]:
        """As ``CompressedCache`` / ``Engine`` take it."""
        return {"kv_bits": self.bits, "kv_group": self.group, "kv_residual": self.residual}

    def describe(self) -> str:
        if not self.quantized:
            return "16-bit (the model's dtype)"
        return f"{self.bits}-bit, groups of {self.group}, residual {self.residual}"


@dataclass
class Packed:
    """Rows ``[N, d]`` of one tensor in ``bits``: ``codes`` ``[N, d * bits / 8]`` uint8 and, per
    group of channels, ``scale`` and ``zero`` ``[N, d / group]`` fp16."""

    codes: Tensor
    scale: Tensor
    zero: Tensor
    bits: int

    def __len__(self) -> int:
        return self.codes.shape[0]

    def take(self, idx: Tensor) -> Packed:
        return Packed(self.codes[idx], self.scale[idx], self.zero[idx], self.bits)

    def put_(self, idx: Tensor, rows: Packed) -> None:
        self.codes[idx], self.scale[idx], self.zero[idx] = rows.codes, rows.scale, rows.zero

    def empty(self, n: int) -> Packed:
        return Packed(self.codes.new_empty(n, self.codes.shape[1]),
                      self.scale.new_empty(n, self.scale.shape[1]),
                      self.zero.new_empty(n, self.zero.shape[1]), self.bits)

    def zeros(self, n: int) -> Packed:
        """``n`` rows that dequantize to 0 (a page's padding)."""
        return Packed(self.codes.new_zeros(n, self.codes.shape[1]),
                      self.scale.new_zeros(n, self.scale.shape[1]),
                      self.zero.new_zeros(n, self.zero.shape[1]), self.bits)

    def clone(self) -> Packed:
        return Packed(self.codes.clone(), self.scale.clone(), self.zero.clone(), self.bits)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.codes, self.scale, self.zero

    @staticmethod
    def cat(parts: list[Packed]) -> Packed:
        return Packed(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), parts[0].bits)


def _toward(x: Tensor, to: float) -> Tensor:
    return torch.nextafter(x, x.new_full((), to))


def quantize(x: Tensor, bits: int, group: int) -> Packed:
    """Rows ``x`` ``[N, d]`` (any float dtype) in ``bits`` with ``group`` channels per scale."""
    n, d = x.shape
    top = 2 ** bits - 1
    xg = x.detach().float().view(n, d // group, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    if n and bool(torch.maximum(hi, -lo).max() > _FP16_MAX):
        raise CacheError(f"a key or value beyond fp16's range ({_FP16_MAX:g}) cannot be "
                         "quantized with fp16 scales; use kv_bits 16")
    zero = lo.half()
    zero = torch.where(zero.float() > lo, _toward(zero, float("-inf")), zero)  # rounded down
    scale = ((hi - zero.float()) / top).half()
    scale = torch.where(scale.float() * top < hi - zero.float(), _toward(scale, float("inf")),
                        scale)  # rounded up
    scale = scale.masked_fill(scale == 0, 1.0)  # a constant group: every code 0
    codes = ((xg - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
    codes = codes.to(torch.uint8).view(n, d)
    if bits == 4:  # two codes a byte: even channels low, odd channels high
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Packed(codes, scale, zero, bits)


def dequantize(p: Packed, dtype: torch.dtype) -> Tensor:
    """The rows of ``p`` as ``[N, d]`` of ``dtype`` (computed in fp32)."""
    codes = p.codes
    if p.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)
    n, d = codes.shape
    groups = p.scale.shape[1]
    out = codes.view(n, groups, d // groups).float()
    out = torch.addcmul(p.zero.float()[..., None], out, p.scale.float()[..., None])
    return out.view(n, d).to(dtype)


__all__ = ["BITS", "KVQuant", "Packed", "dequantize", "quantize"]
