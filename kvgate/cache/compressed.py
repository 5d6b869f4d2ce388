"""CompressedCache: a transformers ``Cache`` that stores only the entries a policy keeps.

How it plugs in: the cache is a ``kvgate.models.dispatch.AttentionHandler``, so after
``dispatch.install(model)`` the router hands every attention call of a forward that carries it
to ``CompressedCache.attend``. ``update`` passes the new keys/values through untouched and
``attend`` does both the attention and the storing, because only there are the query, the
mask and the normalised layer input known together.

Per layer, the first call is the prefill: the policy sees the whole prompt (``LayerPrompt``)
and returns a keep mask; the prompt attends fully (or under the eq. 5 mask for an
``EncodeMasking`` policy, or block by block for a ``StreamingPrefill`` one), then only kept
entries are stored (``RaggedStore``). Later calls append new tokens and attend over the ragged
store; a ``DecodeEvicting`` policy holds each head at a capacity through
``decode_init`` / ``decode_select`` (a ``RowScoring`` one also scores each new entry from its
own row, ``row_stats``). The policy's contract is read from its class
(``kvgate.policies.contract``), never probed.

Positions: a cache that evicts holds fewer entries than tokens seen, so everything that
transformers derives from the cache length (``get_seq_length``, ``get_mask_sizes``) reports
the *seen* length, and new tokens get their true positions. The 4-D mask transformers builds
cannot describe a ragged store, so after the prefill it is used only to tell real tokens from
padding; visibility (causal, sliding window) comes from the stored true positions.

Quantized (``kv_bits`` 8 or 4, ``kvgate.cache.quant``): the stores hold kept entries as codes
(the newest ``kv_residual`` positions exact as well) and attention reads them dequantized;
which entries stay, and the policies' scores, are decided exactly as at 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.attention.paged import PagedKV
from kvgate.attention.rows import RowKV
from kvgate.cache.capacity import check_decode_budget, decode_capacity
from kvgate.cache.errors import CacheError
from kvgate.cache.evict import decode_round, flush_tail, round_due
from kvgate.cache.handler import HandlerCache
from kvgate.cache.passes import defers_choice, pass_attention, stash_layer
from kvgate.cache.prefill import (
    causal_attention_lse,
    causal_attention_sums,
    new_token_validity,
    positions_after,
    prompt_attention,
)
from kvgate.cache.quant import KVQuant
from kvgate.cache.ragged import RaggedStore
from kvgate.cache.streaming import stream_prefill
from kvgate.models.dispatch import ForwardContext, install
from kvgate.policies.contract import (
    Budget,
    DecodeEvicting,
    EncodeMasking,
    LayerPrompt,
    PassAttention,
    Policy,
    PolicyError,
    RowScoring,
    StreamingPrefill,
)


@dataclass
class _Layer:
    """Cache state of one decoder layer."""

    store: RaggedStore | None = None
    seen: int = 0  # tokens fed so far, padding included (what transformers' positions count)
    real_seen: Tensor | None = None  # [B] real tokens fed so far
    capacity: Tensor | None = None  # [B, H_kv] decode budget (decode-evicting policies)
    stats: dict[str, Tensor] = field(default_factory=dict)  # [B, H_kv, T] per-slot policy state
    pending: bool = False  # update() seen, attend() not yet
    # the new rows written since the last eviction round, which a RowScoring policy scores at
    # the next one (kvgate.cache.evict.round_due)
    unscored: list[LayerPrompt] = field(default_factory=list)
    unscored_rows: int = 0  # their rows
    scores: Tensor | None = None  # [B, H_kv, T] an all-layer choice's scores (cache.passes)
    forced: Tensor | None = None  # [B, H_kv, T] bool, its forced entries


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


class CompressedCache(HandlerCache):
    """A KV cache that really shrinks: per layer and KV head it holds only the kept entries.

    Args:
        model_or_config: the model (then ``dispatch.install(model)`` is called for you) or
            its config.
        policy: which entries stay (``kvgate.policies``).
        budget: prompt entries each KV head keeps (``Budget``, ratio or token count).
        decode_budget: for ``DecodeEvicting`` policies, the size each head is held at while
            decoding: None = the per-head counts right after the prefill; an int > 1 = that
            many tokens; a float in (0, 1] = that share of the sample's real prompt length.
        allow_attention_scores: False for backends that never materialise attention
            probabilities; policies that need them are then refused.
        kv_bits, kv_group, kv_residual: how kept entries are stored (``KVQuant``): 16 as the
            model gives them; 8 or 4 bits in groups of ``kv_group`` channels with an fp16
            scale and zero point each, the newest ``kv_residual`` positions also held exact.
            Eviction and the policies' scores work the same either way; attention reads the
            base dequantized.

    Usable as ``model.generate(..., past_key_values=cache)`` or in a manual loop. One cache
    serves one batch of prompts; make a new one (or ``reset()``) for the next batch.
    """

    def __init__(self, model_or_config: nn.Module | Any, policy: Policy,
                 budget: Budget | float | str, decode_budget: Budget | float | None = None,
                 *, allow_attention_scores: bool = True, kv_bits: int = 16, kv_group: int = 32,
                 kv_residual: int = 64) -> None:
        if isinstance(model_or_config, nn.Module):
            install(model_or_config)
            config = model_or_config.config
        else:
            config = model_or_config
        self.model_config = config = _text_config(config)  # forks and variants are built on it
        try:
            self.num_layers = int(config.num_hidden_layers)
            heads = int(config.num_attention_heads)
            self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        except AttributeError as exc:
            raise CacheError(f"CompressedCache needs a decoder config, got {type(config).__name__}"
                             ) from exc
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.kv = KVQuant(kv_bits, kv_group, kv_residual)
        self.kv.group_for(self.head_dim)  # a group that does not split the heads: one line now
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a kvgate Policy, got {type(policy).__name__}")
        if policy.needs_attention and not allow_attention_scores:
            raise PolicyError(f"policy {policy.name!r} needs attention scores, which this "
                              "attention backend cannot give")
        self.policy = policy
        self.budget = Budget.parse(budget)
        self.decode_budget = check_decode_budget(decode_budget)
        self.awaiting_passes = False  # a PassScoring policy's passes have not chosen yet
        self._pass_valid: Tensor | None = None  # [B, r] real rows of the pass under way
        super().__init__(layers=[_Layer() for _ in range(self.num_layers)])

    # ----------------------------------------------------------------- transformers API

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[Tensor, Tensor]:
        """Pass-through: ``attend`` stores the entries once it knows what to keep."""
        layer = self._layer(layer_idx)
        if layer.pending:
            raise CacheError("CompressedCache.attend was never called: route the model's "
                             "attention through kvgate first (kvgate.models.dispatch.install(model))")
        layer.pending = True
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens *seen* (padding included), not entries stored: transformers derives the
        positions of new tokens from this."""
        return self.layers[layer_idx].seen if layer_idx < self.num_layers else 0

    @property
    def is_initialized(self) -> bool:
        return self.layers[0].store is not None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        store = self.layers[0].store
        return -1 if store is None else store.batch

    def reset(self) -> None:
        self.layers = [_Layer() for _ in range(self.num_layers)]
        self.awaiting_passes, self._pass_valid = False, None

    def _unsupported(self, what: str):
        raise CacheError(f"CompressedCache does not support {what} (use greedy or sampling "
                         "without beams or assistant models)")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._unsupported("beam search")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("repeating the batch (num_return_sequences > 1 or beams)")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._unsupported("selecting batch rows")

    # ----------------------------------------------------------------- measurements

    @property
    def seen_tokens(self) -> Tensor:
        """Real (non-padding) tokens seen per sample: ``[B]`` long."""
        real = self.layers[0].real_seen
        if real is None:
            raise CacheError("the cache is empty: run a prefill first")
        return real

    def kept_counts(self, layer_idx: int) -> Tensor:
        """Entries held per (sample, KV head) in one layer: ``[B, H_kv]`` long."""
        store = self._layer(layer_idx).store
        if store is None:
            raise CacheError(f"layer {layer_idx} holds nothing yet: run a prefill first")
        return store.kept_counts()

    def kept_fraction(self, layer_idx: int | None = None) -> float:
        """Held entries over real tokens seen x KV heads, for one layer or all of them."""
        layers = range(self.num_layers) if layer_idx is None else [layer_idx]
        kept = sum(int(self.kept_counts(i).sum()) for i in layers)
        seen = sum(int(self.layers[i].real_seen.sum()) for i in layers) * self.kv_heads
        return kept / max(seen, 1)

    def kept_fractions(self) -> list[float]:
        """Per-layer kept fraction."""
        return [self.kept_fraction(i) for i in range(self.num_layers)]

    def bytes_held(self) -> int:
        """Bytes of every tensor the cache holds (K/V, or their codes, scales, zero points and
        the residual window's exact copies; true positions, counts)."""
        return sum(layer.store.nbytes() for layer in self.layers if layer.store is not None)

    def full_bytes(self) -> int:
        """Bytes a dense cache would hold for the tokens seen: B x H_kv x seen x 2 x d."""
        return sum(s.batch * s.kv_heads * layer.seen * 2 * s.head_dim
                   * torch.empty((), dtype=s.dtype).element_size()
                   for layer in self.layers if (s := layer.store) is not None)

    def store_as(self, kv: KVQuant) -> None:
        """Hold kept entries as ``kv`` says from now on; layers filled so far are converted
        (``SharedPrefill`` / ``SharedPasses`` fill full-precision caches: each variant's is
        converted before it answers). A fork or stack made before keeps its own stores."""
        kv.group_for(self.head_dim)
        self.kv = kv
        for layer in self.layers:
            if layer.store is not None:
                layer.store = layer.store.converted(kv, layer.real_seen)

    def new_pass_scores(self, store: RaggedStore) -> Tensor:
        """Zero running scores ``[B, H_kv, T]`` before the passes (SharedPasses: per scorer)."""
        return torch.zeros(store.batch, store.kv_heads, store.base_len, device=store.device)

    def score_pass(self, part: PassAttention) -> Tensor:
        """One block of pass rows' scores, shaped like ``new_pass_scores``."""
        return self.policy.pass_scores(part).float()

    # ----------------------------------------------------------------- attention

    def attend(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None,
               hidden: Tensor | None = None, position_embeddings: Any = None,
               context: ForwardContext | None = None, **kwargs) -> tuple[Tensor, None]:
        """Attention for one layer call; stores what the policy keeps.

        query [B, H, r, d], key/value [B, H_kv, r, d] (post-RoPE), hidden [B, r, D] (the
        layer's normalised input), position_embeddings the forward's rotary (cos, sin);
        ``context`` (the router's) gives a prefill policy the previous layer's input.
        Returns ``(out [B, r, H, d], None)`` like transformers' attention functions.
        """
        layer = self._layer(module.layer_idx)
        layer.pending = False
        if scaling is None:
            scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        b, _, r, _ = query.shape
        valid = new_token_validity(attention_mask, b, r, query.device)
        window = kwargs.get("sliding_window") or None
        if self._pass_valid is not None and layer.store is not None:
            return pass_attention(self, layer, module, query, key, value, self._pass_valid,
                                  scaling, hidden, window), None
        previous = (context.call(module.layer_idx - 1).hidden
                    if context is not None and module.layer_idx > 0 else None)
        if layer.store is None:
            prompt = LayerPrompt(module.layer_idx, self.num_layers, query, key, value, valid,
                                 scaling, hidden, module, position_embeddings, previous)
            out = self._prefill(layer, prompt, attention_mask, window, kwargs)
        else:
            if self.awaiting_passes:
                raise CacheError(f"policy {self.policy.name!r} chooses after its extra passes "
                                 "(kvgate.inference.compress.run_passes): run them first")
            if layer.store.batch != b:
                raise CacheError(f"batch of {b} rows, but this cache was filled with "
                                 f"{layer.store.batch}; use a new cache for a new batch")
            written = None
            if isinstance(self.policy, RowScoring):  # the new rows score their own entries
                written = LayerPrompt(module.layer_idx, self.num_layers, query, key, value,
                                      valid, scaling, hidden, module, position_embeddings,
                                      previous)
            out = self._step(layer, query, key, value, valid, scaling, window,
                             all_valid=True if attention_mask is None else None,
                             written=written)
        return out, None

    def _prefill(self, layer: _Layer, prompt: LayerPrompt, mask: Tensor | None,
                 window: int | None, kwargs: dict) -> Tensor:
        module, key, valid = prompt.module, prompt.key, prompt.valid
        b, hk, _, d = key.shape
        if hk != self.kv_heads or d != self.head_dim:
            raise CacheError(f"layer {module.layer_idx} gives {hk} KV heads of dim {d}; the "
                             f"config says {self.kv_heads} of dim {self.head_dim}")
        layer.store = RaggedStore(b, hk, d, key.dtype, key.device, self.kv)
        layer.real_seen = torch.zeros(b, dtype=torch.long, device=key.device)
        if isinstance(self.policy, StreamingPrefill):
            out = stream_prefill(self, layer, prompt, mask, window, kwargs)
        elif (fused := self._fused_prefill(prompt, mask, window)) is not None:
            out, prompt.lse = fused  # the attention first: the policy reads its log-sum-exp
            self._store_kept(layer, prompt, self._keep(prompt))
        else:
            keep = self._keep(prompt)
            out = prompt_attention(self.policy, prompt, keep, mask, window, **kwargs)
            self._store_kept(layer, prompt, keep)
        layer.capacity = self._decode_capacity(layer.store.kept_counts(), valid.sum(-1))
        return out

    def _wants_lse(self) -> bool:
        """Whether the policy sums attention probabilities of a full prefill (so the fused
        kernel's log-sum-exp saves it work)."""
        return self.policy.needs_attention and not isinstance(self.policy, EncodeMasking)

    def _fused_prefill(self, prompt: LayerPrompt, mask: Tensor | None,
                       window: int | None) -> tuple[Tensor, Tensor] | None:
        if not self._wants_lse():
            return None
        if self.policy.column_sums:  # the sums from the attention's own probabilities
            both = causal_attention_sums(prompt.query, prompt.key, prompt.value, mask,
                                         prompt.valid, prompt.scaling, window)
            if both is not None:
                out, prompt.derived["column_sums"] = both
                return out, None
        return causal_attention_lse(prompt.query, prompt.key, prompt.value, mask, prompt.valid,
                                    prompt.scaling, window)

    def _store_kept(self, layer: _Layer, prompt: LayerPrompt, keep: Tensor) -> None:
        """Store the prompt's kept entries (and a decode-evicting policy's statistics)."""
        layer.store.append(prompt.key, prompt.value, positions_after(prompt.valid, layer.real_seen))
        kept = layer.store.rebuild(keep)
        if isinstance(self.policy, DecodeEvicting):
            stats = self.policy.decode_init(prompt, keep)
            layer.stats = {k: layer.store.realign(v, kept) for k, v in stats.items()}
        layer.seen, layer.real_seen = prompt.key.shape[2], prompt.n_real
        if defers_choice(self.policy):  # every entry stored; all layers choose at once
            stash_layer(self, layer, prompt, kept)

    def _step(self, layer: _Layer, query: Tensor, key: Tensor, value: Tensor, valid: Tensor,
              scaling: float, window: int | None, evict: bool | None = None,
              prefill: bool = False, all_valid: bool | None = None,
              written: LayerPrompt | None = None) -> Tensor:
        """New rows after the prefill (decode steps, or prompt blocks when streaming).

        ``all_valid``: True when the caller knows no new row is padding (no mask was given),
        which spares a device sync per layer. ``written``: the new rows as a ``LayerPrompt``,
        for a ``RowScoring`` policy.
        """
        store = layer.store
        r = key.shape[2]
        if all_valid is None:
            all_valid = bool(valid.all())
        if all_valid:  # the usual decode step: fewer small ops than the general formula
            qpos = layer.real_seen[:, None] + torch.arange(r, device=valid.device)
        else:
            qpos = positions_after(valid, layer.real_seen)
        store.append(key, value, qpos, padded=not all_valid)
        tb = store.base_len
        tail_k, tail_v = store.tail_kv()
        evict = isinstance(self.policy, DecodeEvicting) if evict is None else evict
        # a decode step ends with a round only every `interval` rows (RowScoring policies)
        evict = evict and (prefill or round_due(self.policy, layer, written))
        # slot positions cost a gather over the base: only when a window or a policy needs them
        positions = store.slot_positions() if (evict or window) else None  # [B, H_kv, T]
        # [B, H_kv, 1, T] the real slots, holes left out, read off the positions when there
        seen = None if positions is None else (positions >= 0)[:, :, None, :]
        rows = qpos[:, None, :, None]  # [B, 1, r, 1]
        base_vis = store.visible_base(None if seen is None else seen[..., :tb])
        if not all_valid:  # padding rows (streamed prompts) see nothing
            base_vis = rows >= 0 if base_vis is None else base_vis & (rows >= 0)
        if window and tb:
            near = positions[:, :, None, :tb] > rows - window
            base_vis = near if base_vis is None else base_vis & near
        tail_vis = None  # one real new row sees every real tail token: no mask needed
        if r > 1 or window or store.tail_padded:
            tpos = store.tail_pos.long()[:, None, None, :]  # [B, 1, 1, t]
            tail_vis = (tpos >= 0) & (tpos <= rows)
            if window:
                tail_vis = tail_vis & (tpos > rows - window)
        holes = store.tail_holes()  # evicted while decoding, not yet compacted
        if holes is not None:
            kept = ~holes if seen is None else seen[..., tb:]
            tail_vis = kept if tail_vis is None else tail_vis & kept
        if store.paged:  # a ragged base read in its pages, where it lies (never None: ragged)
            keys, values, seg, grid = store.pages()
            base = PagedKV(keys, values, base_vis, seg, grid, tb, store.kv_heads)
        elif store.by_rows and all_valid and not window:
            # flat rows of few segments, other segments' rows and holes hidden by the store's
            # bias (a window or padding rows need the per-row slot mask: gathered below)
            base = RowKV(*store.rows_part(), base_vis, tb, store.kv_heads)
        else:  # a view of a uniform or padded base, or a flat one gathered padded
            base = KVPart(*store.base_kv(), base_vis)
        out, logits = multipart_attention(query, [base, KVPart(tail_k, tail_v, tail_vis)],
                                          scaling, return_logits=evict)
        layer.seen += r
        layer.real_seen = layer.real_seen + (r if all_valid else valid.sum(-1))
        if evict:
            if prefill and written is not None:  # a streamed block rounds at once
                layer.unscored.append(written)
            decode_round(self.policy, layer, logits, positions, prefill, seen[:, :, 0])
        flush_tail(layer)  # a quantized store's full-precision tail joins its base
        return out

    # ----------------------------------------------------------------- helpers

    def _layer(self, layer_idx: int) -> _Layer:
        if not 0 <= layer_idx < self.num_layers:
            raise CacheError(f"layer {layer_idx} out of range: the cache was built for "
                             f"{self.num_layers} layers")
        return self.layers[layer_idx]

    def _keep(self, prompt: LayerPrompt) -> Tensor:
        if defers_choice(self.policy):  # stored whole; chosen for all layers at once
            return prompt.valid[:, None, :].expand(-1, self.kv_heads, -1)
        keep = self.policy.keep(prompt, self.budget)
        want = (prompt.key.shape[0], prompt.key.shape[1], prompt.key.shape[2])
        if tuple(keep.shape) != want:
            raise PolicyError(f"policy {self.policy.name!r} returned keep of shape "
                              f"{tuple(keep.shape)}, expected {want}")
        return keep.to(torch.bool) & prompt.valid[:, None, :]

    def _decode_capacity(self, counts: Tensor, n_real: Tensor) -> Tensor:
        return decode_capacity(self.decode_budget, counts, n_real)

    def __repr__(self) -> str:
        kv = f", kv={self.kv.describe()!r}" if self.kv.quantized else ""
        return (f"CompressedCache(policy={self.policy.name!r}, budget={self.budget.describe()}, "
                f"layers={self.num_layers}, kv_heads={self.kv_heads}{kv})")
