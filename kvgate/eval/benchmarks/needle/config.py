"""``kvgate eval needle``'s options: passkey retrieval by context length and depth; the cache's
storage (``--kv-bits``) for the scorings over a real cache (generate, rank in ``--mode
cache``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.eval.config import CorpusConfig, _at_least, _one_of, parse_numbers
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.eval.qa_options import (
    check_qa,
    kv_bits_opt,
    kv_cache_only,
    kv_group_opt,
    kv_residual_opt,
    kv_settings,
    paired_opt,
    score_opt,
)


@dataclass
class NeedleConfig(CorpusConfig):
    """Passkey retrieval by context length and depth."""

    lengths: str | list[int] = opt("1024,2048", "context lengths in tokens")
    depths: str | list[float] = opt("0,25,50,75,100", "needle depths in %")
    samples: int = opt(5, "prompts per (length, depth)")
    scoring: str = opt("rank", "rank the key among distractors, or generate an answer (always "
                       "over the compressed cache)", choices=("rank", "generate"))
    distractors: int = opt(9, "other keys a ranked key competes with")
    max_new_tokens: int = opt(8, "tokens to generate")
    query_aware: bool = opt(False, "compress the whole prompt, question included (the old "
                            "setting; its keys have no -agnostic suffix); by default the "
                            "question is asked after [intro | filler ... needle ...] is "
                            "compressed")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()
    kv_bits: int = kv_bits_opt()
    kv_group: int = kv_group_opt()
    kv_residual: int = kv_residual_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.samples, "--samples")
        _at_least(self.max_new_tokens, "--max-new-tokens")
        _at_least(self.distractors, "--distractors", 0)
        _one_of(self.scoring, "--scoring", ("rank", "generate"))
        self.lengths = parse_numbers(self.lengths, "lengths", int)
        self.depths = parse_numbers(self.depths, "depths", float)
        check_qa(self)
        if self.scoring == "rank" and self.score != ["generate"]:
            raise EvalError("--score applies to --scoring generate (rank scores by ranking)")
        # generate always asks over a real cache; rank only in --mode cache
        kv_cache_only(self, self.scoring == "generate" or self.mode == "cache",
                      "--scoring rank in --mode masked")

    def settings(self) -> dict[str, Any]:
        scorer = ({"distractors": self.distractors} if self.scoring == "rank"
                  else {"max_new_tokens": self.max_new_tokens, "score": self.score})
        # the seed also draws the keys and the filler offsets; the sample count the offsets
        return {**super().settings(), "seed": self.seed, "samples": self.samples, **scorer,
                "query_aware": bool(self.query_aware), **kv_settings(self)}
