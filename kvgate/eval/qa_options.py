"""The options every question-answering benchmark shares (needle with ``scoring="generate"``,
ruler, longbench, a new one): ``score`` (``generate``, ``teacher`` or both:
:mod:`kvgate.eval.runner`) and ``paired`` (a policy each row's score is compared with on the
same examples: :mod:`kvgate.eval.paired`); and how the compressed cache stores kept entries
(``kv_bits``, ``kv_group``, ``kv_residual``: :class:`kvgate.cache.quant.KVQuant`), for every
command that scores over a real cache: ruler, longbench, needle, and ppl, mc and matched in
``--mode cache`` (their masked mode has no cache to store: ``kv_cache_only`` refuses 8 or 4
bits there). Light, as every config is: the configs are read to build the command line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvgate.eval.config import _items
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt

if TYPE_CHECKING:
    from kvgate.cache.quant import KVQuant

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


def kv_bits_opt() -> Any:
    return opt(16, "how the cache stores kept keys and values: 16 (the model's dtype), 8 or 4 "
               "bits in groups of --kv-group channels, each with an fp16 scale and zero point")


def kv_group_opt() -> Any:
    return opt(32, "channels per scale and zero point at --kv-bits 8 or 4 (a head with fewer "
               "is one group)")


def kv_residual_opt() -> Any:
    return opt(64, "at --kv-bits 8 or 4, the newest tokens also held in full precision")


def kv_storage(cfg: Any) -> KVQuant:
    """The cache storage a config's ``kv_bits`` / ``kv_group`` / ``kv_residual`` ask for; one
    line naming the flag if a value is refused."""
    from kvgate.cache.errors import CacheError
    from kvgate.cache.quant import KVQuant

    try:
        return KVQuant.from_flags(cfg.kv_bits, cfg.kv_group, cfg.kv_residual)
    except CacheError as exc:
        raise EvalError(str(exc)) from None


def kv_settings(cfg: Any) -> dict[str, Any]:
    """The storage as a result's settings (:mod:`kvgate.eval.identity`): the bits, and at 8
    or 4 bits the group and the residual window (which change scores only then)."""
    kv = kv_storage(cfg)
    if not kv.quantized:
        return {"kv_bits": kv.bits}
    return {"kv_bits": kv.bits, "kv_group": kv.group, "kv_residual": kv.residual}


def kv_cache_only(cfg: Any, cache: bool, where: str = "--mode masked") -> None:
    """:func:`kv_storage`'s check, and one line if ``cfg`` asks for 8 or 4 bits where
    ``where`` scores without a cache (``cache`` False): the keep decisions are then attention
    masks over the keys and values the model computes, which nothing stores, so the bits
    would change nothing."""
    if kv_storage(cfg).quantized and not cache:
        raise EvalError(f"--kv-bits {cfg.kv_bits} sets how a real cache stores kept entries, "
                        f"and {where} has none (the keep decisions are attention masks over "
                        "the model's own keys and values): add --mode cache")
