"""The options every question-answering benchmark shares (needle with ``scoring="generate"``,
ruler, longbench, a new one): ``score`` (``generate``, ``teacher`` or both:
:mod:`kvgate.eval.runner`) and ``paired`` (a policy each row's score is compared with on the
same examples: :mod:`kvgate.eval.paired`). Light, as every config is: the configs are read to
build the command line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgate.eval.config import _items
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt

SCORES = ("generate", "teacher")


def score_opt() -> Any:
    return opt("generate", "how answers are scored: generate (greedy decoding, the task's "
               "metric), teacher (the gold answers fed once: mean log-likelihood and "
               "greedy-exact), or generate,teacher (both, and their agreement)")


def paired_opt() -> Any:
    return opt(None, "a policy label: each row also gets its score less that policy's on the "
               "same examples, with a paired interval (per family and averaged)",
               metavar="POLICY")


def check_scores(scores: str | Sequence[str]) -> list[str]:
    """The scorers named (``generate``, ``teacher``), in that order; one line if unknown."""
    given = _items(scores)
    if not given or any(s not in SCORES for s in given) or len(set(given)) != len(given):
        raise EvalError(f"--score must be one or both of {', '.join(SCORES)}, got "
                        f"{','.join(given) or 'nothing'}")
    return [s for s in SCORES if s in given]


def check_qa(cfg: Any) -> None:
    """``score`` as a list of scorers; ``paired`` one of the run's policy labels."""
    cfg.score = check_scores(cfg.score)
    labels = [p.partition("=")[0].strip() for p in cfg.policies]
    if cfg.paired is not None and cfg.paired not in labels and labels != ["all"]:
        raise EvalError(f"--paired {cfg.paired}: not a label of --policies "
                        f"({', '.join(labels)})")
