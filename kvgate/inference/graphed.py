"""Decode steps over a ``StaticDecodeCache``, captured once as a CUDA graph and replayed.

Eager decode of a compressed cache on a GPU spends most of a step on the host (Python and
kernel launches; ``bench/bench_decode.py --profile``). A CUDA graph records the step's kernels
once and replays them with one launch, so the step costs what its kernels cost, and there a
cache holding half the entries reads half the bytes. The same driver runs any cache whose
decode step has fixed shapes and no host reads (transformers' ``StaticCache`` too, the dense
baseline of the benchmark). Off CUDA it runs the identical step eagerly, which is what the
CPU tests check.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kvgate.cache.compressed import CompressedCache
from kvgate.cache.errors import CacheError
from kvgate.cache.static import StaticDecodeCache


class GraphedDecoder:
    """One decode step, ``step(tokens) -> logits``, with fixed input buffers.

    Args:
        model: the (kvgate-installed, for a ``StaticDecodeCache``) causal LM.
        cache: a cache with a fixed-shape decode step.
        next_pos: ``[B, 1]`` long: each row's RoPE position of the next token.
        cache_position: the next token's index in the padded sequence (the cache's seen
            length for kvgate's caches, the write slot for transformers' ``StaticCache``).
        max_steps: how many steps the cache has room for.
        graphs: capture a CUDA graph (default: when the model is on CUDA).
        warmup: eager steps run on a side stream before the capture (CUDA's advice); the
            cache is put back afterwards, so they leave no trace.
    """

    def __init__(self, model: nn.Module, cache: Any, next_pos: Tensor, cache_position: int,
                 max_steps: int, graphs: bool | None = None, warmup: int = 2) -> None:
        if not (isinstance(cache, StaticDecodeCache) or getattr(cache, "is_compileable", False)):
            raise CacheError(f"GraphedDecoder needs a fixed-shape cache (StaticDecodeCache."
                             f"freeze(...) or transformers' StaticCache), got "
                             f"{type(cache).__name__}")
        if next_pos.dim() != 2 or next_pos.shape[1] != 1 or next_pos.is_floating_point():
            raise CacheError(f"next_pos must be a [batch, 1] integer tensor, got "
                             f"{next_pos.dtype} of shape {tuple(next_pos.shape)}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise CacheError(f"max_steps must be an int >= 1, got {max_steps!r}")
        device = next_pos.device
        self.model, self.cache, self.max_steps = model, cache, max_steps
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise CacheError(f"CUDA graphs need a CUDA device, the decode runs on {device}")
        self.ids = torch.zeros(next_pos.shape[0], 1, dtype=torch.long, device=device)
        self.pos = next_pos.clone().long()
        self.cpos = torch.full((1,), cache_position, dtype=torch.long, device=device)
        self.steps = 0
        self.graph: Any = None
        self.logits: Tensor | None = None
        if self.graphs:  # warm-up steps write real slots: no more than the cache has
            self._capture(max(1, min(warmup, max_steps)))

    @torch.no_grad()
    def _forward(self) -> Tensor:
        out = self.model(input_ids=self.ids, position_ids=self.pos, cache_position=self.cpos,
                         past_key_values=self.cache, use_cache=True)
        self.pos.add_(1)
        self.cpos.add_(1)
        return out.logits[:, -1]

    def _counters(self) -> list[Tensor]:
        # transformers' StaticCache layers write at their own device counter of tokens seen
        # (cumulative_length), not at cache_position: a warm-up step advances it too
        layers = getattr(self.cache, "layers", ())
        return [c for c in (getattr(layer, "cumulative_length", None) for layer in layers)
                if isinstance(c, Tensor)]

    def _state(self) -> tuple:
        cache = self.cache.snapshot() if hasattr(self.cache, "snapshot") else None
        counters = [c.clone() for c in self._counters()]
        return cache, self.pos.clone(), self.cpos.clone(), counters

    def _restore(self, state: tuple) -> None:
        if state[0] is not None:
            self.cache.restore(state[0])
        self.pos.copy_(state[1])
        self.cpos.copy_(state[2])
        for counter, saved in zip(self._counters(), state[3]):
            counter.copy_(saved)

    def _warm(self, steps: int) -> None:
        """Run ``steps`` eager steps (on a side stream on CUDA, as capture wants) and put the
        cache, the positions and the caches' own counters back: no trace left."""
        state = self._state()
        if self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(steps):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
        else:
            for _ in range(steps):
                self._forward()
        self._restore(state)

    def _capture(self, warmup: int) -> None:
        self._warm(warmup)
        state = self._state()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self._restore(state)  # capturing ran the Python side once more

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row ``[B]``; the next logits ``[B, V]``, a buffer that the
        following step overwrites (copy it to keep it)."""
        if self.steps >= self.max_steps:
            raise CacheError(f"GraphedDecoder: the cache has room for {self.max_steps} steps")
        self.ids.copy_(tokens.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
            if hasattr(self.cache, "note_replays"):
                self.cache.note_replays()
        else:
            self.logits = self._forward()
        self.steps += 1
        return self.logits


def graphed_steps(model: nn.Module, cache: Any, next_pos: Tensor, seen: int,
                  steps: int) -> GraphedDecoder:
    """The fixed-shape decode of ``steps`` tokens after a prefill: a ``CompressedCache`` is
    frozen first (``StaticDecodeCache``; the cache itself stays as the prefill left it), any
    other cache (transformers' ``StaticCache``) is driven as it is. ``seen``: the padded
    length so far (the next token's cache position)."""
    if isinstance(cache, CompressedCache):
        cache = StaticDecodeCache.freeze(cache, steps)
    return GraphedDecoder(model, cache, next_pos, seen, steps)
