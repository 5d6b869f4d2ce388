"""The learned gates' settings, every kind's, and their checks (Attention-Gate paper symbols as
field names). Below the gate kinds: each kind's module reads its settings from here, and
:mod:`kvgate.gate.config` (``GateConfig``) adds the checks that need the registry of kinds
(``kvgate.gate.kinds``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from kvgate.attention.kernels import KERNELS, AttentionKernel
from kvgate.errors import KVGateError

GateMode = Literal["causal", "prompt_bidirectional"]
GateTarget = Literal["kv", "query"]
GatePrefill = Literal["gated", "full"]
GateKernel = AttentionKernel  # the kernel names live beside the kernels
# a name of kvgate.gate.kinds.GATES: "attention" (the paper's Attention-Gate), "mlp" and
# "linear" (each token scored from its own hidden state, KVzap), or a kind registered there
GateKind = str


class ConfigError(KVGateError, ValueError):
    """A configuration value is out of range or unknown; the message names the key."""


@dataclass
class GateSettings:
    """Gate hyper-parameters (``GateConfig``, :mod:`kvgate.gate.config`, checks the kind too).

    Defaults follow the Attention-Gate paper's continual pre-training setting (tau 0.5,
    gamma 2, alpha 5, beta 0.4, h'=4). ``head_dim=None`` means "the model's head_dim".
    ``heads``, ``head_dim``, ``rope`` and ``mode`` shape the attention kind only; ``hidden``
    the mlp kind only.
    """

    # "attention": the Attention-Gate (Zeng et al. 2024, arXiv:2410.12876); "mlp": per layer
    # D -> hidden -> H_gate with GELU, "linear": D -> H_gate, both from the token's own
    # normalised hidden state (KVzap, arXiv:2601.07891; the Attention-Gate paper's "local")
    kind: GateKind = "attention"
    hidden: int = 512  # the mlp kind's inner width (KVzap: 512)
    heads: int = 4  # h': heads of the gate's own small attention
    head_dim: int | None = None  # d'_k; None -> the model's head_dim
    tau: float = 0.5  # keep threshold on sigmoid(score + gamma)
    gamma: float = 2.0  # offset inside the sigmoid; > 0 starts with retention near 1
    alpha: float = 5.0  # weight of the eviction loss
    beta: float = 0.4  # target retention (mean keep flag); must be <= tau
    mode: GateMode = "causal"  # gate attention: causal, or bidirectional over the prompt only
    target: GateTarget = "kv"  # one flag per KV head (what the cache stores) or per query head
    rope: bool = True  # apply the model's rotary positions to the gate's q'/k'
    previous_layer: bool = False  # layer l's flags from layer l-1's input (paper ablation 4-x)
    ungated_layers: int = 0  # the first k layers keep every token
    sinks: int = 0  # always-kept first tokens (count as kept)
    recent: int = 0  # always-kept last keys of every query / last prompt tokens
    # "gated": the paper's eq. 5, every token evicts for every later one (also inside a prompt);
    # "full": one-shot, trained on prompt + continuation blocks: the prompt attends fully and
    # only the continuation reads the gated prompt, as when a heuristic compresses after prefill
    prefill: GatePrefill = "gated"
    # gated attention's kernel (kvgate.attention): "chunked" runs anywhere; "triton" is
    # FlashAttention-2-style Triton kernels (CUDA); "flex" is block-sparse FlexAttention, trains
    # on CUDA only; "auto" picks per device and dtype (triton for bf16 / fp16 on CUDA, chunked
    # elsewhere: choose_kernel)
    kernel: GateKernel = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        bad = self._bad

        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden < 1:
            raise bad("hidden", "must be a positive integer")
        if not isinstance(self.heads, int) or self.heads < 1:
            raise bad("heads", "must be a positive integer")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise bad("head_dim", "must be a positive integer or null")
        if not 0.0 < self.tau < 1.0:
            raise bad("tau", "must lie in (0, 1)")
        if self.gamma < 0:
            raise bad("gamma", "must be >= 0")
        if self.alpha < 0:
            raise bad("alpha", "must be >= 0")
        if not 0.0 <= self.beta <= self.tau:
            raise bad("beta", f"must lie in [0, tau={self.tau}] (paper: beta in [0, tau])")
        if self.mode not in ("causal", "prompt_bidirectional"):
            raise bad("mode", "must be 'causal' or 'prompt_bidirectional'")
        if self.prefill not in get_args(GatePrefill):
            raise bad("prefill", "must be 'gated' or 'full'")
        if self.kernel not in KERNELS:
            raise bad("kernel", f"must be one of {list(KERNELS)}")
        if self.target not in ("kv", "query"):
            raise bad("target", "must be 'kv' or 'query'")
        for key in ("ungated_layers", "sinks", "recent"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise bad(key, "must be a non-negative integer")

    def _bad(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"GateConfig.{key}: {why} (got {getattr(self, key)!r})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"GateConfig: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
