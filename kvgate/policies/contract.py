"""What a policy is: the inputs it sees, the budget it is given and the contracts it declares.

Every policy answers one question at the prefill (``Policy.keep``): given one layer's prompt
(``LayerPrompt``) and a ``Budget``, which (token, KV head) entries stay? It returns a boolean
keep mask ``[B, H_kv, n]``. A policy that does more says so by subclassing, and the cache
checks the class (``isinstance``), never the presence of a method:

- ``DecodeEvicting``: also holds each KV head at a capacity while decoding, through
  ``decode_init`` (per-entry statistics from the prompt) and ``decode_select`` (one eviction
  round over the stored entries after new rows attended);
- ``RowScoring`` (a ``DecodeEvicting``): scores each new entry from its own row when it is
  written (``row_stats``: a local gate reads the token's hidden state), so ``decode_select``
  finds the new slots' statistics filled in rather than 0;
- ``StreamingPrefill`` (a ``DecodeEvicting``): evicts *while* the prompt is encoded, in blocks
  of ``block`` rows, each block one ``decode_select(..., prefill=True)`` round (RoCo);
- ``EncodeMasking``: its keep decision is applied *inside* the prefill (Attention-Gate eq. 5),
  so later prompt rows attend only to kept entries (plus an ``encode_recent`` band);
- ``PassScoring``: chooses for every layer at once after the whole prompt is encoded, from
  extra forward passes of the model over the full prompt cache (KVzip's repeat pass).

Budget meaning, written down once: a budget is the number of prompt entries each KV head
keeps, given either as a ratio of the *real* (non-padding) prompt length or as an absolute
token count. Sinks, recent windows and observation windows are *inside* the budget.
A budget at or above the prompt length keeps everything (no-op). A scored policy with
``allocation="global"`` (``policies.base.AllocationOption``) spends the same total, budget x
layers x KV heads per sample, on one ranking over all layers and heads instead.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from kvgate.errors import KVGateError

ROUNDINGS = ("up", "nearest")  # how a ratio budget becomes a whole number of entries


class PolicyError(KVGateError, ValueError):
    """Bad policy name, option or budget; the message says which."""


@dataclass(frozen=True)
class Budget:
    """How many prompt entries each KV head keeps: ``ratio`` of the real length or ``tokens``.

    A ratio's count is rounded ``up`` (default: never below the ratio) or to the ``nearest``
    whole token, which keeps a ratio taken from another policy's eviction unbiased on average
    (matched budgets: on an 8-token prompt rounding up turns 22% eviction into 12.5%)."""

    ratio: float | None = None
    tokens: int | None = None
    rounding: str = "up"

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.tokens is None):
            raise PolicyError("budget: give exactly one of ratio (0, 1] or tokens (>= 1)")
        if self.rounding not in ROUNDINGS:
            raise PolicyError(f"budget rounding must be one of {', '.join(ROUNDINGS)}, "
                              f"got {self.rounding!r}")
        if self.ratio is not None and not (0.0 < float(self.ratio) <= 1.0):
            raise PolicyError(f"budget ratio must lie in (0, 1], got {self.ratio}")
        if self.tokens is not None and (int(self.tokens) != self.tokens or self.tokens < 1):
            raise PolicyError(f"budget tokens must be an integer >= 1, got {self.tokens}")

    @classmethod
    def parse(cls, value: float | str | Budget) -> Budget:
        """``0.5`` -> keep half; ``128`` (an integer > 1) -> keep 128 tokens per head."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError as exc:
                raise PolicyError(f"budget {value!r} is neither a ratio nor a token count") from exc
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            # None included: a budget is required even where the policy ignores it (pass 1.0)
            raise PolicyError(f"budget must be a ratio in (0, 1] or a token count >= 1, got "
                              f"{value!r}")
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if isinstance(value, int) and value > 1:
            return cls(tokens=value)
        if isinstance(value, int) and value == 1:
            return cls(ratio=1.0)
        return cls(ratio=float(value))

    def per_sample(self, n_real: Tensor) -> Tensor:
        """Kept entries per KV head for each sample: ``[B]`` long, clamped to ``[1, n_real]``."""
        if self.ratio is not None:
            exact = n_real.to(torch.float64) * self.ratio
            kept = (torch.floor(exact + 0.5) if self.rounding == "nearest"
                    else torch.ceil(exact - 1e-9)).long()
        else:
            kept = torch.full_like(n_real, int(self.tokens))
        return torch.minimum(kept.clamp(min=1), n_real)

    def describe(self) -> str:
        return f"{self.ratio:g} of the prompt" if self.ratio is not None else f"{self.tokens} tokens"


@dataclass
class LayerPrompt:
    """What a policy sees of one layer at prefill. Shapes: B batch, H query heads, H_kv KV
    heads, n prompt length (left padded), d head dim, D hidden size. q/k are post-RoPE."""

    layer_idx: int
    num_layers: int
    query: Tensor  # [B, H, n, d]
    key: Tensor  # [B, H_kv, n, d]
    value: Tensor  # [B, H_kv, n, d]
    valid: Tensor  # [B, n] bool; False at left padding
    scaling: float  # softmax scale (usually 1/sqrt(d))
    hidden: Tensor | None = None  # [B, n, D] the normalised layer input (learned gate)
    module: Any = None  # the attention module (gives the learned gate access to kv_gate)
    # the rotary (cos, sin) of this forward, each [B, n, d_rot] (the learned gate rotates its
    # own q/k with them)
    position_embeddings: Any = None
    # [B, n', D] n' >= n: the previous decoder layer's normalised input in this forward. No
    # policy reads it since the previous_layer gate went (issue #62); kept while
    # kvgate/cache/compressed.py still passes it (by position, before ``lse``)
    previous_hidden: Tensor | None = None
    # [B, H, n] fp32: each prompt row's log-sum-exp of its causal attention logits, when the
    # prefill's fused kernel gave it (unpadded CPU prefills); lets a policy that sums attention
    # probabilities over every row (H2O) skip the softmax's normalising passes
    lse: Tensor | None = None
    # what a policy computed from this layer's prompt and needs again in the same call (H2O's
    # column sums: once to choose at prefill, once to seed decode-time eviction); lives and
    # dies with this object, which the cache builds per layer call (init=False: a copy made
    # with dataclasses.replace, e.g. some rows or a prefix of the prompt, starts empty)
    derived: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    @property
    def n_real(self) -> Tensor:
        return self.valid.sum(-1)

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    def head(self, rows: int) -> LayerPrompt:
        """The prompt's first ``rows`` positions (what a streamed prefill has encoded so far)."""
        return self.span(0, rows)

    def span(self, lo: int, hi: int) -> LayerPrompt:
        """Positions ``lo:hi`` of the prompt (a streamed block's rows)."""
        pe, prev = self.position_embeddings, self.previous_hidden
        return replace(self, query=self.query[:, :, lo:hi], key=self.key[:, :, lo:hi],
                       value=self.value[:, :, lo:hi], valid=self.valid[:, lo:hi],
                       hidden=None if self.hidden is None else self.hidden[:, lo:hi],
                       position_embeddings=None if pe is None else tuple(x[:, lo:hi] for x in pe),
                       previous_hidden=None if prev is None else prev[:, lo:hi],
                       lse=None if self.lse is None else self.lse[..., lo:hi])

    @staticmethod
    def joined(parts: Sequence[LayerPrompt]) -> LayerPrompt:
        """Consecutive row blocks of one layer as one block (``span``'s inverse): the rows a
        ``RowScoring`` policy scores at once when its eviction rounds wait (``interval``)."""
        if len(parts) == 1:
            return parts[0]

        def cat(get: Callable[[LayerPrompt], Any], dim: int) -> Any:
            first = get(parts[0])
            if first is None:
                return None
            if isinstance(first, tuple):  # the rotary (cos, sin)
                return tuple(torch.cat([get(p)[i] for p in parts], dim)
                             for i in range(len(first)))
            return torch.cat([get(p) for p in parts], dim)

        return replace(parts[0], query=cat(lambda p: p.query, 2), key=cat(lambda p: p.key, 2),
                       value=cat(lambda p: p.value, 2), valid=cat(lambda p: p.valid, 1),
                       hidden=cat(lambda p: p.hidden, 1),
                       position_embeddings=cat(lambda p: p.position_embeddings, 1),
                       previous_hidden=cat(lambda p: p.previous_hidden, 1),
                       lse=cat(lambda p: p.lse, -1))


class Policy(ABC):
    """The one-shot contract. Subclasses are dataclasses with validated options and implement
    ``keep``; the cache stores what it returns and attends over it.

    ``needs_attention``: ``keep`` needs attention probabilities (so the attention backend must
    be able to produce them). ``budget_free``: ``keep`` ignores the budget (the full cache, the
    thresholded gate); an evaluation then runs it once, not once per budget.
    ``column_sums``: ``keep`` reads ``prompt.derived["column_sums"]`` when present (each
    key's attention summed over the prompt's rows, ``[B, H, n]``), which the cache can give
    from the prefill's own attention in the same pass.
    ``encode_mask``: whether the prompt is encoded under the keep mask (see ``EncodeMasking``);
    False for every policy that does not subclass it.
    ``needs_gate``: ``keep`` reads the layer's trained gate, so the policy runs only on a gated
    model (commands and benches load one for it, or refuse in one line).
    """

    name: str = "base"
    needs_attention: bool = False
    budget_free: bool = False
    column_sums: bool = False
    encode_mask: bool = False
    needs_gate: bool = False

    @abstractmethod
    def keep(self, prompt: LayerPrompt, budget: Budget) -> Tensor:
        """Return ``[B, H_kv, n]`` bool. Padding positions must be False."""


class DecodeEvicting(Policy):
    """A policy that also holds each KV head at a capacity while decoding.

    After the prefill the cache calls ``decode_init`` once per layer; after every later
    attention call (a decode step, or a streamed prompt block) it calls ``decode_select`` with
    the logits of the new rows over every stored entry, in the per-head slot layout
    ``[B, H_kv, T]`` of the cache, and keeps what it returns.
    """

    @abstractmethod
    def decode_init(self, prompt: LayerPrompt, keep: Tensor) -> dict[str, Tensor]:
        """Per-entry statistics of the prompt, each ``[B, H_kv, n]`` float (the cache keeps the
        kept entries' values aligned with their slots; new slots arrive as 0). ``keep`` is
        what ``keep`` returned; its per-head count is the budget."""

    @abstractmethod
    def decode_select(self, stats: dict[str, Tensor], logits: Tensor, valid: Tensor,
                      positions: Tensor, capacity: Tensor, prefill: bool = False,
                      ) -> tuple[dict[str, Tensor], Tensor]:
        """One eviction round.

        stats: each ``[B, H_kv, T]`` (or empty); logits ``[B, H, r, T]`` of the r new rows
        (-inf where a row cannot see a slot); valid ``[B, H_kv, T]`` bool (slots in use);
        positions ``[B, H_kv, T]`` long true token positions (-1 where invalid); capacity
        ``[B, H_kv]`` long. ``prefill`` is True while a streamed prompt is encoded
        (``StreamingPrefill``), False while decoding. Returns the updated stats and the keep
        mask ``[B, H_kv, T]`` with ``min(capacity, valid count)`` True per head; a
        ``budget_free`` policy keeps what its own rule keeps instead (the local gate: above
        its threshold or recent) and ignores ``capacity``.
        """


class RowScoring(DecodeEvicting):
    """A decode-evicting policy that scores each new entry from its own row when the row is
    written: a local gate (KVzap, arXiv:2601.07891) reads only the token's hidden state, so a
    generated token gets its keep score as it enters the cache, like a prompt token at the
    prefill. Before each ``decode_select`` the cache calls ``row_stats`` on the new rows and
    stores what it returns in their slots (where other policies' new slots start at 0).

    ``interval``: decode rows between eviction rounds. Since a row's score needs nothing but
    its own row, scoring may wait: the cache keeps the rows written since the last round and,
    once there are ``interval`` of them (or sooner, before a quantized store's tail is
    compacted: ``kvgate.cache.evict.round_due``), scores them in one ``row_stats`` call and
    runs one ``decode_select`` round; until then nothing is evicted, so the cache holds up to
    ``interval - 1`` rows more than the rule keeps. 1: a round after every attention call.
    A streamed prefill (``prefill=True``) rounds after every block whatever this is."""

    interval: int = 1

    @abstractmethod
    def row_stats(self, rows: LayerPrompt) -> dict[str, Tensor]:
        """Per-entry statistics of the new rows, each ``[B, H_kv, r]`` float: ``rows`` is a
        ``LayerPrompt`` of the r new rows (their q/k/v, validity, hidden state, the previous
        layer's input and rotary tables), keyed as ``decode_init``'s statistics."""


class StreamingPrefill(DecodeEvicting):
    """A policy that evicts while encoding: the cache feeds the prompt in blocks of ``block``
    rows (aligned to the prompt's end), each block attends to what the earlier blocks left and
    ends with one ``decode_select(..., prefill=True)`` round at the budget. ``keep`` is its
    one-shot stand-in where no cache streams the prompt (masked scoring)."""

    block: int = 1  # prompt rows per streamed block (>= 1)


class EncodeMasking(Policy):
    """A policy whose keep mask is applied inside the prefill (Attention-Gate eq. 5): prompt
    row j sees key t only if t is kept or ``j - t < max(band, 1)``. ``encode_band(prompt)``
    says, for one layer's prompt, whether that happens and with which band: by default the
    class's ``encode_mask`` / ``encode_recent``; the learned gate reads its layer's trained
    configuration. None: the prompt is encoded with full attention and only the stored cache
    is compressed, as for one-shot policies."""

    encode_mask: bool = True
    encode_recent: int = 0  # prompt keys within this distance stay visible inside the prefill

    def encode_band(self, prompt: LayerPrompt) -> int | None:
        """The recent band of this prompt's eq. 5 prefill, or None for a full prefill."""
        return int(self.encode_recent) if self.encode_mask else None


# ``ask(text, extra)``: the token ids that ask ``text`` after a prompt, with the ids ``extra``
# appended to the request before it closes (chat template: the user turn's end and the
# generation prompt follow; plain: a new line). Built from the tokenizer by the caller.
Ask = Callable[[str, Sequence[int]], list[int]]


@dataclass
class PassAttention:
    """One attention call of an extra pass (``PassScoring``), for a block of the pass's rows.

    Shapes: B batch, H query heads, H_kv KV heads, r pass rows of this block (left padded), T
    stored prompt slots per head (slot t of sample b holds its t-th real prompt token), d head
    dim, D hidden size."""

    layer_idx: int
    num_layers: int
    # [B, H, r, T] fp32: each pass row's attention probability on each stored prompt entry;
    # the softmax runs over the stored prompt and the pass's own rows up to the row (causal)
    probs: Tensor
    valid: Tensor  # [B, r] bool: real pass rows (padding rows' probabilities are 0)
    value: Tensor  # [B, H_kv, T, d] the stored prompt values
    stored: Tensor  # [B, T] bool: real prompt slots
    hidden: Tensor | None = None  # [B, r, D] the pass rows' normalised layer input
    module: Any = None  # the attention module (o_proj for KVzip+)


class PassScoring(Policy):
    """A policy that chooses for every layer at once, after the whole prompt is encoded, from
    extra forward passes of the model over the full prompt cache (KVzip's repeat pass).

    The cache encodes the prompt with full attention and stores every real entry. Whoever owns
    the model and the tokenizer (``kvgate.inference.compress.run_passes``, which
    ``Engine.prefill`` / ``generate`` / ``compress`` call) then feeds each of
    ``passes(ids, valid, ask)`` through the model over that cache: each layer's attention call
    of a pass attends over the stored prompt plus the pass's own causal rows, stores nothing,
    and hands
    ``pass_scores`` a ``PassAttention`` per block of rows; an entry's score is the maximum
    over blocks and passes. ``choose(scores, valid, budget)`` then gives every layer's keep
    mask, and the cache drops the rest: the passes leave no entry, position or length behind.
    Until then the cache refuses new tokens. ``keep`` is its one-shot stand-in where no pass
    is run (masked scoring)."""

    needs_attention = True

    @abstractmethod
    def passes(self, ids: Tensor, valid: Tensor, ask: Ask) -> list[tuple[Tensor, Tensor]]:
        """The extra passes over a prompt ``ids`` [B, n] long (``valid`` [B, n] bool, left
        padded): a list of ``(ids [B, m] long, valid [B, m] bool)``, left padded (a sample
        with nothing to read in a pass has an all-padding row)."""

    @abstractmethod
    def pass_scores(self, attention: PassAttention) -> Tensor:
        """``[B, H_kv, T]`` float scores of the stored prompt entries from one block of rows
        (higher = keep); the cache keeps their running maximum."""

    @abstractmethod
    def choose(self, scores: Tensor, valid: Tensor, budget: Budget) -> Tensor:
        """Every layer's keep mask at once: scores ``[L, B, H_kv, T]``, valid ``[B, T]`` bool
        (slot t = the sample's t-th real prompt token) -> ``[L, B, H_kv, T]`` bool."""

    def pass_key(self) -> Hashable:
        """What ``passes`` depends on: policies with equal keys read the very same passes, so
        one run of them can serve all (``kvgate.cache.shared_passes``). The default shares
        only with an equal policy."""
        return repr(self)

    def scorer_key(self) -> Hashable:
        """What ``pass_scores`` depends on: policies with equal keys raise the same running
        scores and differ only in ``choose`` (budget, allocation). Default: an equal policy."""
        return repr(self)


def prefill_band(policy: Policy, prompt: LayerPrompt) -> int | None:
    """The recent band of the eq. 5 prefill mask when ``policy`` encodes ``prompt`` under its
    keep mask; None when the prefill attends fully (every policy but an ``EncodeMasking``)."""
    return policy.encode_band(prompt) if isinstance(policy, EncodeMasking) else None
