"""The lm-evaluation-harness model ``kvgate``: any lm-eval task scored over kvgate's compressed
KV cache.

Every request's context is prefilled into a ``CompressedCache`` (the policy keeps its share of
each KV head's entries), then the continuation is scored (``loglikelihood``,
``loglikelihood_rolling``) or generated (``generate_until``) over what was kept. Batches are
left padded; real tokens keep their true positions.

Model arguments (``--model_args k=v,...``)::

    pretrained     base model: an alias (smollm2-135m), a local folder, a .gguf or a hub id
    checkpoint     a gated export (``kvgate export``); its recorded base unless pretrained
    policy         a kvgate policy name (default with a checkpoint: local_gate for a local
                   gate kind, attention_gate otherwise; else full)
    budget         prompt entries kept per KV head: a ratio in (0, 1] or a token count
    decode_budget  the decode-time capacity of decode-evicting policies (see ``Engine``)
    attn           sdpa (default) or flash
    kv_bits        how kept keys and values are stored: 16 (default, the model's dtype), 8 or 4
    kv_group       channels per scale and zero point at 8 or 4 bits (default 32)
    kv_residual    the newest tokens also held in full precision at 8 or 4 bits (default 64)
    dtype          auto (bfloat16 on CUDA, float32 on the CPU) or a dtype name
    max_length     tokens per request (default: the model's max_position_embeddings)
    max_gen_toks   generation length when a task gives none (default 256)
    rolling_context  tokens of context each loglikelihood_rolling window after the first is
                   scored after (lm-eval's context_len; default 1, as lm-eval's hf model)
    anything else  an option of the policy (window=32, kernel=7, ...)

Tokenisation follows kvgate's own scorer (``kvgate.eval.multiple_choice.mc_item``): the
tokenizer's special tokens (BOS) are added to the context, a continuation's tokens are those
of ``context + continuation`` after the context's own, so on the same examples this model's
log-likelihoods equal ``cache_scores``'.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own model table, registered before ours)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from torch import nn
from tqdm.auto import tqdm

from kvgate.cache.quant import KVQuant
from kvgate.checkpoint import gate_kind, load_gated
from kvgate.errors import KVGateError
from kvgate.eval.errors import encode, model_shape
from kvgate.inference import Engine
from kvgate.integrations.lm_eval.scoring import (
    PairScores,
    batches,
    fit_pair,
    rolling_pairs,
    score_pairs,
)
from kvgate.models import load_base, parse_dtype
from kvgate.policies import Budget, PolicyError, get_policy
from kvgate.policies.registry import gate_policy_name

log = logging.getLogger("kvgate.integrations.lm_eval")

_DEFAULT_AUTO_BATCH = 8


class LMEvalError(KVGateError, ValueError):
    """A model argument of ``--model kvgate`` that cannot be used; the message names it."""


def _device(device: str | torch.device | None) -> torch.device:
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        if device is not None:
            log.warning("kvgate: device %s is not available; running on the CPU", device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _batch_size(value: Any, max_batch_size: Any) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        # each batch is one compressed cache: no probing, a fixed size (max_batch_size or 8)
        return int(max_batch_size or _DEFAULT_AUTO_BATCH)
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise LMEvalError(f"batch_size must be an integer or 'auto', got {value!r}") from None
    if size < 1:
        raise LMEvalError(f"batch_size must be >= 1, got {size}")
    return size


def _whole(value: Any, name: str) -> Any:
    """A model argument that should be an int, as lm-eval hands it (an int, or its text)."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise LMEvalError(f"{name} must be an integer, got {value!r}") from None
    return value


def _cut_at_stops(text: str, until: list[str]) -> str:
    cuts = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(cuts)] if cuts else text


@register_model("kvgate")
class KVGateLM(TemplateLM):
    """lm-eval's ``--model kvgate`` (see the module docstring for its arguments).

    ``pretrained`` may also be a loaded model (then pass ``tokenizer``), for use from Python
    through ``lm_eval.simple_evaluate(model=KVGateLM(...))``.
    """

    def __init__(self, pretrained: str | nn.Module | None = None, checkpoint: str | None = None,
                 policy: str | None = None, budget: float | str = 1.0,
                 decode_budget: float | None = None, attn: str = "sdpa", dtype: str = "auto",
                 device: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, rolling_context: int = 1, tokenizer: Any = None,
                 trust_remote_code: bool | None = None, kv_bits: int | str = 16,
                 kv_group: int | str = 32, kv_residual: int | str = 64,
                 **policy_options: Any) -> None:
        super().__init__()
        del trust_remote_code  # kvgate loads only architectures it knows
        if pretrained is None and checkpoint is None:
            raise LMEvalError("--model kvgate needs pretrained=<alias|folder|hub id> and/or "
                              "checkpoint=<gated export>")
        # the settings that need no model are checked before any weights load
        name = policy or (gate_policy_name(gate_kind(checkpoint)) if checkpoint is not None
                          else "full")
        try:
            chosen = get_policy(name, **policy_options)
        except PolicyError as err:
            raise LMEvalError(f"{err} (model_args other than kvgate's own go to the policy)"
                              ) from None
        self.batch_size = _batch_size(batch_size, max_batch_size)
        budget = Budget.parse(budget)  # PolicyError (a KVGateError) names a bad one
        kv = KVQuant(*(_whole(v, n) for v, n in ((kv_bits, "kv_bits"), (kv_group, "kv_group"),
                                                  (kv_residual, "kv_residual"))))
        self._device = _device(device)
        torch_dtype = (torch.bfloat16 if self._device.type == "cuda" else torch.float32) \
            if dtype in (None, "auto") else parse_dtype(dtype)
        model, tok = self._load(pretrained, checkpoint, tokenizer, torch_dtype)
        if tok is None:
            raise LMEvalError("no tokenizer: pass tokenizer= with a loaded model, or a "
                              "pretrained name/folder")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.model, self.tokenizer = model.eval(), tok
        self.engine = Engine(self.model, tok, chosen, budget, decode_budget=decode_budget,
                             attn=attn, **kv.kwargs())
        config = getattr(self.model, "config", None)
        self.max_length = int(max_length or getattr(config, "max_position_embeddings", 0)
                              or 2048)
        self.max_gen_toks = int(max_gen_toks)
        self.rolling_context = int(rolling_context)
        if self.max_length < 2 or not 1 <= self.rolling_context <= self.max_length:
            raise LMEvalError(f"need max_length >= 2 and 1 <= rolling_context <= max_length, "
                              f"got {self.max_length} and {self.rolling_context}")
        self.pad = int(tok.pad_token_id)
        self.kept_entries = 0  # context KV entries kept so far, over layers x KV heads
        self.context_entries = 0  # ... and what a full cache would have held
        log.info("kvgate: policy %s at %s on %s", chosen.name, self.engine.budget.describe(),
                 self._device)

    def _load(self, pretrained: Any, checkpoint: str | None, tokenizer: Any,
              dtype: torch.dtype) -> tuple[nn.Module, Any]:
        if isinstance(pretrained, nn.Module):
            base: Any = (pretrained.to(self._device), tokenizer)
        else:
            base = None if pretrained is None else str(pretrained)
        if checkpoint is not None:
            model, tok, _ = load_gated(str(checkpoint), base=base, dtype=dtype,
                                       device=self._device)
            return model, tok if tok is not None else tokenizer
        if isinstance(base, tuple):
            return base
        return load_base(base, dtype=dtype, device=self._device)

    # ---------------------------------------------------------------------- lm-eval API

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # what an empty context is scored after: BOS where the tokenizer has one
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kvgate")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return encode(self.tokenizer, string, special=special)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """(log p(continuation | compressed context), greedy?) per (key, context, cont)."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # empty continuation
        pairs = {i: fit_pair(list(ctx), list(cont), self.max_length)
                 for i, (_, ctx, cont) in enumerate(requests) if cont}
        # longest first: the least padding per batch, and an out-of-memory shows at once
        order = sorted(pairs, key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for chunk in tqdm(batches(order, self.batch_size), disable=disable_tqdm,
                          desc="kvgate loglikelihood"):
            scores = score_pairs(self.engine, [pairs[i][0] for i in chunk],
                                 [pairs[i][1] for i in chunk], self.pad)
            self._count(scores)
            for i, ll, greedy in zip(chunk, scores.loglik, scores.greedy):
                out[i] = (ll, bool(greedy))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Whole-text log-likelihood over disjoint windows of at most ``max_length`` tokens,
        each scored after its compressed context (see ``rolling_context``)."""
        owners, windows = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0], add_special_tokens=False)
            for ctx, cont in rolling_pairs(tokens, self.prefix_token_id, self.max_length,
                                           self.rolling_context):
                owners.append(i)
                windows.append((None, ctx, cont))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owners, scores):
            totals[i] += ll
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        self._report("loglikelihood_rolling")
        return totals

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._report("loglikelihood")
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Decode each context (compressed at the prefill) until a stop string, EOS or
        ``max_gen_toks``; greedy unless the task asks for sampling."""
        out = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # one decoding setting per batch
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            greedy = not kwargs.pop("do_sample", False) or temperature == 0.0
            seed = kwargs.pop("seed", None)
            if kwargs:
                log.warning("kvgate: generation settings %s are not supported and ignored",
                            sorted(kwargs))
            prompts = {i: self._fit_prompt(requests[i].args[0], max_new) for i in idx}
            order = sorted(idx, key=lambda i: -len(prompts[i][1]))
            for chunk in tqdm(batches(order, self.batch_size), disable=disable_tqdm,
                              desc="kvgate generate_until"):
                result = self.engine.generate([prompts[i][0] for i in chunk], max_new,
                                              greedy=greedy, temperature=temperature or 1.0,
                                              seed=seed)
                self._count_generation(result.stats.kept_fraction, result.stats.prompt_tokens)
                for i, text in zip(chunk, result.texts):
                    out[i] = _cut_at_stops(text, until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        self._report("generate_until")
        return out

    # ---------------------------------------------------------------------- helpers

    def _fit_prompt(self, context: str, max_new: int) -> tuple[str, list[int]]:
        """The prompt (cut from the left so that it and ``max_new`` tokens fit ``max_length``)
        and its tokens."""
        ids = self.tok_encode(context)
        room = max(1, self.max_length - max_new)
        if len(ids) <= room:
            return context, ids
        log.warning("kvgate: a %d-token prompt is cut to its last %d tokens", len(ids), room)
        ids = ids[-room:]
        return self.tokenizer.decode(ids, skip_special_tokens=True), ids

    def _count(self, scores: PairScores) -> None:
        self.kept_entries += scores.kept
        self.context_entries += scores.total

    def _count_generation(self, kept_fraction: float, prompt_tokens: list[int]) -> None:
        layers, kv_heads = model_shape(self.model)
        total = layers * kv_heads * sum(prompt_tokens)
        self.kept_entries += round(kept_fraction * total)
        self.context_entries += total

    @property
    def kept_fraction(self) -> float:
        """Context KV entries kept over those a full cache holds, over every request so far."""
        return self.kept_entries / max(self.context_entries, 1)

    def _report(self, what: str) -> None:
        if self.context_entries:
            log.info("kvgate %s: policy %s kept %.1f%% of the context KV entries", what,
                     self.engine.policy.name, 100.0 * self.kept_fraction)
