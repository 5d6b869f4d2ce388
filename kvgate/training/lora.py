"""LoRA wiring through peft: which projections get adapters, and how they are told apart.

LoRA is added *before* the gates are patched in: peft matches target modules by name suffix,
and the gate has its own ``q_proj``/``k_proj``/... that must never receive adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from kvgate.training.errors import TrainingConfigError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the paper's W_q, W_k, W_v, W_o


@dataclass
class LoraSettings:
    """LoRA hyper-parameters (used when ``train`` is ``gates_lora`` or ``lora``)."""

    rank: int = 16  # r: rank of the update B @ A
    alpha: float = 32.0  # lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.05  # dropout on the adapter's input
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # module names

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(key: str, why: str) -> TrainingConfigError:
            return TrainingConfigError(f"LoraSettings.{key}: {why} (got {getattr(self, key)!r})")

        if not isinstance(self.rank, int) or self.rank < 1:
            raise bad("rank", "must be a positive integer")
        if self.alpha <= 0:
            raise bad("alpha", "must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", "must lie in [0, 1)")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise bad("targets", "must be a non-empty list of module names")


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Wrap ``model`` in a peft ``PeftModel`` with LoRA on ``settings.targets`` of the base.

    peft freezes every non-adapter parameter. Raises ``TrainingConfigError`` when a target
    names no module of the model (peft's own error comes from deep inside its tuner).
    """
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in settings.targets if t not in names]
    if missing:
        raise TrainingConfigError(
            f"LoraSettings.targets: {missing} name no module of this model "
            f"(attention projections are {sorted(n for n in names if n.endswith('_proj'))})")
    gated = any("kv_gate" in name for name, _ in model.named_modules())
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.targets), bias="none", task_type="CAUSAL_LM",
        # a model patched before LoRA: keep adapters off the gate's own projections
        exclude_modules=r".*kv_gate.*" if gated else None,
    )
    return get_peft_model(model, config)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA A/B matrices of ``model`` (empty when it carries no adapter)."""
    return [p for name, p in model.named_parameters() if ".lora_" in name]
