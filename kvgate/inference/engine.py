"""Generation with a compressed cache: prefill, compact, decode, and what it cost.

``Engine`` owns the loop instead of calling ``model.generate`` so that it can time the
prefill and the decode separately and report the cache's real size. The model call per step
is the ordinary transformers forward; the cache (``CompressedCache``) does the eviction.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.attention.masks import left_pad
from kvgate.cache import CompressedCache
from kvgate.cache.quant import KVQuant
from kvgate.inference.compress import (
    CompressedContext,
    budget_text,
    bytes_held_text,
    run_passes,
    two_columns,
)
from kvgate.inference.compress import answer as answer_questions
from kvgate.inference.compress import compress as compress_contexts
from kvgate.inference.decode import decode, left_padded_positions, until_eos
from kvgate.models import dispatch
from kvgate.models.limits import context_limit, fit_to_context, quiet_length_warning
from kvgate.models.load import sync_device
from kvgate.policies.base import Budget, Policy, PolicyError
from kvgate.policies.contract import DecodeEvicting

ATTN_BACKENDS = ("sdpa", "flash")


@dataclass
class GenerationStats:
    """What one ``Engine.generate`` call cost. Kept fractions are measured right after the
    prefill (share of prompt entries still held, over layers x KV heads x real tokens)."""

    prompt_tokens: list[int]
    new_tokens: int
    kept_fraction: float
    kept_fraction_per_layer: list[float]
    bytes_held: int  # K/V, or their codes, scales and zero points (+ positions) at the end
    bytes_full: int  # what a dense cache would hold for the same tokens
    prefill_ms: float
    decode_tokens_per_s: float
    policy: str = ""
    budget: str = ""
    kv: str = ""  # how kept entries are stored (KVQuant.describe)

    @property
    def evicted_percent(self) -> float:
        return 100.0 * (1.0 - self.kept_fraction)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"evicted_percent": self.evicted_percent}

    def table(self) -> str:
        """A two-column text table for terminals."""
        per_layer = " ".join(f"{100 * f:.0f}" for f in self.kept_fraction_per_layer)
        rows = [
            ("policy", f"{self.policy} ({self.budget})"),
            ("prompt tokens", ", ".join(map(str, self.prompt_tokens))),
            ("new tokens", str(self.new_tokens)),
            ("kept (prompt)", (f"{100 * self.kept_fraction:.1f}%  (evicted "
                               f"{self.evicted_percent:.1f}%)")),
            ("kept per layer %", per_layer),
            ("KV bytes held", bytes_held_text(self.bytes_held, self.bytes_full)),
            *([("KV storage", self.kv)] if self.kv else []),
            ("prefill", f"{self.prefill_ms:.1f} ms"),
            ("decode", f"{self.decode_tokens_per_s:.1f} tokens/s"),
        ]
        return two_columns(rows)


@dataclass
class GenerationResult:
    texts: list[str]  # generated continuation per prompt (special tokens skipped)
    token_ids: list[list[int]]  # generated ids per prompt, up to and including EOS
    stats: GenerationStats
    prompt_ids: list[list[int]] = field(default_factory=list)


class Engine:
    """Prefill + decode of a (possibly gated) causal LM under one eviction policy.

    Args:
        model: a LLaMA, Mistral or Qwen causal LM (``kvgate.models.load_base`` or ``load_gated``).
        tokenizer: its tokenizer (prompts are left padded).
        policy: a ``Policy`` or a registered name (``policy_options`` then go to it).
        budget: prompt entries kept per KV head (ratio or tokens, see ``Budget``).
        decode_budget: capacity while decoding for decode-evicting policies (see
            ``CompressedCache``).
        attn: "sdpa" (policies may compute attention scores) or "flash" (fused attention
            only; policies that need attention scores are refused).
        truncate: a prompt longer than the model's context (with the tokens to generate) is
            cut to its end, with a warning; by default it is refused (``InputTooLongError``).
        graphs: decode at fixed shapes over the cache frozen after the prefill, one CUDA graph
            replayed per token on CUDA (eager decode there is bound by the host, not by the
            bytes the cache holds); not for policies that evict while decoding. Same tokens.
        kv_bits, kv_group, kv_residual: how the cache stores kept entries (16: as the model
            gives them; 8 or 4 bits: ``kvgate.cache.quant.KVQuant``), in every cache this
            engine makes, ``compress_shared``'s included. With ``graphs`` the frozen base is
            held dequantized (a fused dequantize-attention kernel is the CUDA path, not here).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, policy: Policy | str,
                 budget: Budget | float | str, decode_budget: float | None = None,
                 attn: str = "sdpa", policy_options: dict[str, Any] | None = None,
                 truncate: bool = False, graphs: bool = False, kv_bits: int = 16,
                 kv_group: int = 32, kv_residual: int = 64) -> None:
        if attn not in ATTN_BACKENDS:
            raise PolicyError(f"attention backend must be one of {', '.join(ATTN_BACKENDS)}, "
                              f"got {attn!r}")
        if isinstance(policy, str):
            from kvgate.policies import get_policy

            policy = get_policy(policy, **(policy_options or {}))
        if policy.needs_attention and attn == "flash":
            raise PolicyError(f"policy {policy.name!r} needs attention scores, which the "
                              "'flash' backend cannot give; use --attn sdpa")
        dispatch.install(model)
        self.model = model
        self.tokenizer = quiet_length_warning(tokenizer)
        self.policy = policy
        self.budget = Budget.parse(budget)
        self.decode_budget = decode_budget
        self.attn = attn
        self.truncate = truncate
        if graphs and isinstance(policy, DecodeEvicting):
            raise PolicyError(f"policy {policy.name!r} evicts while decoding, so its decode "
                              "steps change shape: graphs=True needs a one-shot policy")
        self.graphs = graphs
        self.kv = KVQuant(kv_bits, kv_group, kv_residual)
        self.new_cache()  # validates decode_budget and the policy against the model now

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> CompressedCache:
        return CompressedCache(self.model, self.policy, self.budget, self.decode_budget,
                               allow_attention_scores=self.attn != "flash", **self.kv.kwargs())

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                ) -> tuple[Tensor, CompressedCache]:
        """Run the prompt (left padded) once: ``(logits [B, n, V], cache)``."""
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        cache = self.new_cache()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=left_padded_positions(attention_mask), past_key_values=cache,
                         use_cache=True)
        run_passes(self.model, self.tokenizer, cache, input_ids, attention_mask)
        return out.logits, cache

    def encode(self, prompts: list[str] | str, reserve: int = 0) -> tuple[Tensor, Tensor]:
        """Tokenise with left padding: ``(input_ids [B, n], attention_mask [B, n])``. Each
        prompt plus ``reserve`` new tokens must fit the model's context (see ``truncate``)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or any(not isinstance(p, str) or not p for p in prompts):
            raise PolicyError("prompts must be a non-empty list of non-empty strings")
        tok = self.tokenizer
        if getattr(tok, "pad_token", None) is None:
            tok.pad_token = tok.eos_token
        rows = fit_to_context([tok(p)["input_ids"] for p in prompts],
                              context_limit(self.model.config), reserve, self.truncate)
        return left_pad(rows, tok.pad_token_id)

    @torch.no_grad()
    def generate(self, prompts: list[str] | str, max_new_tokens: int = 32, greedy: bool = True,
                 temperature: float = 1.0, seed: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` per prompt (stops at EOS per sample)."""
        if max_new_tokens < 1:
            raise PolicyError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not greedy and temperature <= 0:
            raise PolicyError(f"temperature must be > 0 for sampling, got {temperature}")
        ids, mask = self.encode(prompts, reserve=max_new_tokens)
        ids, mask = ids.to(self.device), mask.to(self.device)
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = eos if pad is None else pad

        cache = self.new_cache()
        device = self.device
        sync_device(device)
        t0 = time.perf_counter()
        positions = left_padded_positions(mask)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        run_passes(self.model, self.tokenizer, cache, ids, mask)  # a PassScoring policy's
        sync_device(device)
        prefill_s = time.perf_counter() - t0
        kept = cache.kept_fraction()
        kept_layers = cache.kept_fractions()

        def pick(logits: Tensor) -> Tensor:
            if greedy:
                return logits.argmax(-1)
            probs = torch.softmax(logits / temperature, dim=-1)
            return torch.multinomial(probs, 1, generator=gen)[:, 0]

        t1 = time.perf_counter()
        generated, steps = decode(self.model, out, mask, positions[:, -1:] + 1, cache,
                                  max_new_tokens, eos, pad, pick, graphs=self.graphs)
        sync_device(device)
        decode_s = time.perf_counter() - t1
        batch = ids.shape[0]

        token_ids = [until_eos(row, eos) for row in generated]
        texts = [self.tokenizer.decode(row, skip_special_tokens=True) for row in token_ids]
        stats = GenerationStats(
            prompt_tokens=mask[:, :ids.shape[1]].sum(-1).tolist(),
            new_tokens=sum(len(row) for row in token_ids),
            kept_fraction=kept,
            kept_fraction_per_layer=kept_layers,
            bytes_held=cache.bytes_held(),
            bytes_full=cache.full_bytes(),
            prefill_ms=1000.0 * prefill_s,
            decode_tokens_per_s=(steps * batch / decode_s) if steps and decode_s > 0 else 0.0,
            policy=self.policy.name,
            budget=budget_text(self.policy, self.budget),
            kv=self.kv.describe() if self.kv.quantized else "",
        )
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask[:, :ids.shape[1]])]
        return GenerationResult(texts, token_ids, stats, prompt_ids)

    def compress(self, contexts: str | list[str], chat: bool = True) -> CompressedContext:
        """Prefill and compress ``contexts`` (no question) once; see ``kvgate.inference.compress``."""
        return compress_contexts(self, contexts, chat=chat)

    def answer(self, compressed: CompressedContext, questions: list[str],
               max_new_tokens: int = 32, answer_prefix: str | None = None) -> list[str]:
        """Answer each question over its own fork of ``compressed`` (greedy)."""
        return answer_questions(self, compressed, questions, max_new_tokens, answer_prefix)
