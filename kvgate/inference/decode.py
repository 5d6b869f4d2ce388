"""Token-by-token decoding over a cache after a prefill, and the small helpers generation and
answering share (positions of a left-padded batch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.inference.graphed import graphed_steps


def left_padded_positions(mask: Tensor) -> Tensor:
    """RoPE positions of a left-padded batch: real tokens count from 0 (pads get 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def decode(model: nn.Module, out: Any, mask: Tensor, next_pos: Tensor, cache: Any,
           max_new_tokens: int, eos: int | None, pad: int | None,
           pick: Callable[[Tensor], Tensor] | None = None,
           graphs: bool = False,
           until: Callable[[Tensor], Tensor] | None = None) -> tuple[list[list[int]], int]:
    """Decode after a prefill whose output is ``out``: each step picks the next token of every
    row from its last logits (``pick``, default greedy), rows that met ``eos`` get ``pad``,
    until ``max_new_tokens`` or every row is done. ``mask`` [B, n] is the attention mask so far,
    ``next_pos`` [B, 1] the next token's position. ``graphs``: run the steps at fixed shapes
    over the cache frozen after the prefill (``kvgate.inference.graphed``: one CUDA graph
    replayed per step on CUDA, the same step eagerly elsewhere; policies that evict while
    decoding are refused), then append what they decoded to ``cache``, so that it holds what
    eager decode leaves. ``until``: the tokens so far [B, t] -> [B] rows that are done (a
    stop rule besides ``eos``). Returns (tokens per row, forwards run)."""
    pick = pick or (lambda logits: logits.argmax(-1))
    batch = mask.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=mask.device)
    tokens: list[Tensor] = []
    logits = out.logits[:, -1]
    stepper = (graphed_steps(model, cache, next_pos, mask.shape[1], max_new_tokens - 1)
               if graphs and max_new_tokens > 1 else None)
    steps = 0
    while True:  # a loop over decode steps
        nxt = pick(logits.float())
        if pad is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        tokens.append(nxt)
        if eos is not None:
            done = done | (nxt == eos)
        if until is not None:
            done = done | until(torch.stack(tokens, dim=1)).to(done.device)
        if len(tokens) == max_new_tokens or bool(done.all()):
            break
        if stepper is not None:
            logits = stepper.step(nxt)
        else:
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos,
                           past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        steps += 1
    if stepper is not None and stepper.cache is not cache and hasattr(stepper.cache, "write_back"):
        stepper.cache.write_back(cache)  # the statistics then count the decoded tokens too
    return torch.stack(tokens, dim=1).tolist(), steps


def until_eos(row: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in row:
        return row[:row.index(eos) + 1]
    return row
