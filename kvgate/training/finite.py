"""A run whose loss or trained tensors stop being finite ends at that step, with no export.

A diverged run (a learning rate far too high, a batch with nothing to score) used to go on to
``max_steps`` printing ``evict%: nan``, exit 0 and export all-NaN gates that every later
command loaded as if trained. ``StopOnNonFinite`` (one of the module's default callbacks)
checks the step's loss and every trainable tensor after each training batch: Lightning runs
the ``ModelCheckpoint`` callbacks after the others, so the step that diverged is never
checkpointed, and the exception ends ``fit`` before ``ExportGated`` writes anything.
``kvgate train`` prints the one line and exits 2.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from kvgate.errors import KVGateError

__all__ = ["NonFiniteError", "StopOnNonFinite", "first_non_finite"]


class NonFiniteError(KVGateError, RuntimeError):
    """The loss or a trained tensor became NaN or infinite: the run stopped at that step."""


def first_non_finite(tensors: list[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or an infinity, None when all are finite.
    One max-abs reduction per tensor and a single host sync, whatever their number."""
    if not tensors:
        return None
    # the infinity norm is a max, which propagates NaN: finite exactly when every entry is
    peaks = torch.stack([n.float() for n in torch._foreach_norm(
        [t.detach() for t in tensors], float("inf"))])
    bad = ~torch.isfinite(peaks)
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])


def _value(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "infinite"


class StopOnNonFinite(Callback):
    """Raises ``NonFiniteError`` at the end of the first training batch whose loss, or any
    trainable tensor after the optimiser step, is not finite (see the module docstring)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        tensors = [p for _, p in named]
        if torch.is_tensor(loss):
            tensors = [loss.reshape(1), *tensors]
        bad = first_non_finite(tensors)
        if bad is None:
            return
        step = trainer.global_step
        optim = getattr(pl_module, "optim_cfg", None)
        rates = (f"model.optim.lr_gate {optim.lr_gate:g}, lr_lora {optim.lr_lora:g}"
                 if optim is not None else "model.optim")
        if torch.is_tensor(loss) and bad == 0:
            what = f"the loss is {_value(loss)}"
            cause = (f"a learning rate too high ({rates}) or a batch with no labelled token "
                     "(labels all -100) are the usual causes")
        else:
            name, param = named[bad - (1 if torch.is_tensor(loss) else 0)]
            what = f"{name} is {_value(param)} after the optimiser step"
            cause = f"a learning rate too high ({rates}) is the usual cause"
        raise NonFiniteError(f"training stopped at step {step}: {what}; {cause}; nothing "
                             "exported, and no checkpoint of this step written")
