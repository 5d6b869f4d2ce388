"""The learned gates' settings that every kind shares, the base of each kind's own settings, and
their checks (Attention-Gate paper symbols as field names). Below the gate kinds: a kind's
file (``kvgate.gate.attention``, ``mlp``, ``linear``) declares its own settings on
``KindSettings``, and :mod:`kvgate.gate.config` (``GateConfig``) joins the shared ones with every
registered kind's (``kvgate.gate.kinds``) into the one flat config a run and an export write."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal, get_args

from kvgate.attention.kernels import KERNELS, AttentionKernel
from kvgate.errors import KVGateError

GateTarget = Literal["kv", "query"]
GatePrefill = Literal["gated", "full"]
GateKernel = AttentionKernel  # the kernel names live beside the kernels
# a name of kvgate.gate.kinds.GATES (GATE_KINDS lists them): checked against the registry when
# a config is built, not typed as a Literal, so that a kind registered later is accepted too
GateKind = str


class ConfigError(KVGateError, ValueError):
    """A configuration value is out of range or unknown; the message names the key."""


def config_error(key: str, why: str, value: Any) -> ConfigError:
    """The one-line refusal of a gate setting: ``GateConfig.KEY: WHY (got VALUE)``."""
    return ConfigError(f"GateConfig.{key}: {why} (got {value!r})")


@dataclass
class KindSettings:
    """The settings one gate kind reads and no other (a kind without any uses this class).

    A kind's file subclasses it with its fields (each with a default, as every field of the
    flat ``GateConfig`` has one) and their checks in ``validate``; ``shapes`` names the fields
    that shape the kind's tensors, which a resumed run must share with its checkpoint."""

    shapes: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``self._bad`` naming the first field out of range (nothing to check here)."""

    def _bad(self, key: str, why: str) -> ConfigError:
        return config_error(key, why, getattr(self, key))


@dataclass
class GateSettings:
    """What every gate kind shares: the threshold and loss, which heads get flags, the forced
    tokens, the prefill and the kernel. Defaults follow the Attention-Gate paper's continual
    pre-training setting (tau 0.5, gamma 2, alpha 5, beta 0.4)."""

    # "attention": the Attention-Gate (Zeng et al. 2024, arXiv:2410.12876); "mlp" and "linear":
    # each token scored from its own normalised hidden state (KVzap, arXiv:2601.07891; the
    # Attention-Gate paper's "local" gate); or a kind registered in kvgate.gate.kinds
    kind: GateKind = "attention"
    tau: float = 0.5  # keep threshold on sigmoid(score + gamma)
    gamma: float = 2.0  # offset inside the sigmoid; > 0 starts with retention near 1
    alpha: float = 5.0  # weight of the eviction loss
    beta: float = 0.4  # target retention (mean keep flag); must be <= tau
    target: GateTarget = "kv"  # one flag per KV head (what the cache stores) or per query head
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
        if not 0.0 < self.tau < 1.0:
            raise bad("tau", "must lie in (0, 1)")
        if self.gamma < 0:
            raise bad("gamma", "must be >= 0")
        if self.alpha < 0:
            raise bad("alpha", "must be >= 0")
        if not 0.0 <= self.beta <= self.tau:
            raise bad("beta", f"must lie in [0, tau={self.tau}] (paper: beta in [0, tau])")
        if self.prefill not in get_args(GatePrefill):
            raise bad("prefill", "must be 'gated' or 'full'")
        if self.kernel not in KERNELS:
            raise bad("kernel", f"must be one of {list(KERNELS)}")
        if self.target not in get_args(GateTarget):
            raise bad("target", "must be 'kv' or 'query'")
        for key in ("ungated_layers", "sinks", "recent"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise bad(key, "must be a non-negative integer")

    def _bad(self, key: str, why: str) -> ConfigError:
        return config_error(key, why, getattr(self, key))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_settings(cls: type[KindSettings], flat: Any) -> KindSettings:
    """A kind's settings read from the flat config by field name; a field the config lacks (a
    kind registered after ``GateConfig`` was built, as a test's) keeps its default."""
    return cls(**{f.name: getattr(flat, f.name) for f in fields(cls) if hasattr(flat, f.name)})
