"""The configs of the commands over corpus texts and long contexts (``kvgate eval needle``,
``ppl``, ``ruler``, ``longbench``), as :mod:`kvgate.eval.config` writes the others: each field
one flag, its default and help declared once (:mod:`kvgate.eval.options`).

The question-answering ones (needle with ``scoring="generate"``, ruler, longbench) also take
``score`` (``generate``, ``teacher`` or both: :mod:`kvgate.eval.runner`) and ``paired`` (a
policy each row's score is compared with on the same examples: :mod:`kvgate.eval.paired`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.eval.config import (
    MODES,
    EvalConfig,
    _at_least,
    _items,
    _one_of,
    parse_budgets,
    parse_numbers,
)
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt

if TYPE_CHECKING:
    from kvgate.eval.commands import EvalOutput, Loader
    from kvgate.policies.base import Budget

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


def parse_ruler_tasks(raw: str | Sequence[str], allow_all: bool = True) -> list[str]:
    """``--tasks`` of the RULER families (``all``: the 13 of kvgate.eval.ruler.TASKS)."""
    from kvgate.eval.ruler.tasks import TASKS

    tasks = _items(raw)
    if allow_all and tasks == ["all"]:
        return list(TASKS)
    if not tasks:
        raise EvalError("--tasks: give at least one task" + (", or all" if allow_all else ""))
    for t in tasks:
        if t not in TASKS:
            raise EvalError(f"--tasks: unknown RULER task {t!r}; known: {', '.join(TASKS)}")
    return tasks


@dataclass
class CorpusConfig(EvalConfig):
    """Scoring commands over corpus texts."""

    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    docs: int = opt(50, "corpus documents to use: the last N of the seeded corpus order "
                    "(after any training prefix)")
    text_files: list[str] | None = opt(None, "use these .txt/.jsonl files instead of the "
                                       "embedded corpus", nargs="*")
    seed: int = opt(0, "seed of the corpus order (and of the needle's keys and offsets)")
    mode: str = opt("masked", "keep decisions as attention masks in one forward, or a real "
                    "compressed cache", choices=MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.docs, "--docs")
        _one_of(self.mode, "--mode", MODES)
        if self.text_files:  # a missing, malformed or non-UTF-8 file: one line before loading
            from kvgate.data import load_text_files

            load_text_files(self.text_files)

    def settings(self) -> dict[str, Any]:
        if self.text_files:
            texts: dict[str, Any] = {"text_files": [str(Path(f).resolve())
                                                    for f in self.text_files]}
        else:
            texts = {"text_files": None, "docs": self.docs, "seed": self.seed}
        return {**super().settings(), **texts}


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

    def run(self, load: Loader | None = None) -> EvalOutput:
        from kvgate.eval.commands import run_needle

        return run_needle(self, load)

    def settings(self) -> dict[str, Any]:
        scorer = ({"distractors": self.distractors} if self.scoring == "rank"
                  else {"max_new_tokens": self.max_new_tokens, "score": self.score})
        # the seed also draws the keys and the filler offsets; the sample count the offsets
        return {**super().settings(), "seed": self.seed, "samples": self.samples, **scorer,
                "query_aware": bool(self.query_aware)}


@dataclass
class PPLConfig(CorpusConfig):
    """Perplexity of the second half of texts given their compressed first half."""

    max_length: int = opt(512, "tokens of each text")
    prefix: float = opt(0.5, "share of each text compressed")
    context: int | None = opt(None, "fixed context length: join the texts into one stream and "
                              "cut windows of context + continuation tokens (overrides "
                              "--max-length/--prefix)")
    continuation: int | None = opt(None, "scored tokens per window (default: = --context)")
    windows: int | None = opt(None, "windows to score (default: all)")
    truncate: bool = opt(False, "cut a text longer than the model's context to it (a warning "
                         "says how much was dropped) instead of refusing it")
    step: int | None = opt(None, "with --mode cache: feed the continuation this many tokens per "
                           "forward, the cache evicting after each (1 = decoding: H2O, TOVA, "
                           "StreamingLLM and local gates hold their capacity); default: one "
                           "forward")

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.step, "--step")
        if self.step is not None and self.mode != "cache":
            raise EvalError("--step feeds the continuation through a real cache: add --mode cache")
        _at_least(self.max_length, "--max-length")
        if not 0.0 < self.prefix < 1.0:
            raise EvalError(f"--prefix must lie in (0, 1), got {self.prefix}")
        _at_least(self.context, "--context")
        _at_least(self.continuation, "--continuation")
        _at_least(self.windows, "--windows")

    def run(self, load: Loader | None = None) -> EvalOutput:
        from kvgate.eval.commands import run_ppl

        return run_ppl(self, load)

    def settings(self) -> dict[str, Any]:
        step = {} if self.step is None else {"step": self.step}
        if self.context is not None:  # window sizes are in the key; --windows only selects
            return {**super().settings(), **step}
        return {**super().settings(), "max_length": self.max_length, "prefix": self.prefix,
                "truncate": bool(self.truncate), **step}


@dataclass
class RulerConfig(EvalConfig):
    """RULER-style task families (kvgate.eval.ruler), question asked after compression."""

    tasks: str | list[str] = opt("all", "comma-separated RULER tasks (kvgate.eval.ruler.TASKS), "
                                 "or all 13")
    lengths: str | list[int] = opt("1024,2048,4096", "context lengths in tokens")
    depths: str | list[float] = opt("0,25,50,75,100", "needle depths in % for the niah "
                                    "families (example s at depth s mod n)")
    limit: int = opt(5, "examples per (task, length)")
    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    query_aware: bool = opt(False, "prefill context and question together under the policy "
                            "(key mode query-aware) instead of asking the question after "
                            "compression")
    chat: bool = opt(True, "plain prompts even when the tokenizer has a chat template")
    seed: int = opt(0, "seed of the generated examples")
    max_new_tokens: int | None = opt(None, "cap on RULER's tokens to generate per family "
                                     "(niah 128, vt 30, cwe 120, fwe 50, qa 32)")
    source: str = opt("generated", "generated (offline, exact lengths), hub (kvpress's RULER, "
                      "lengths 4096-131072) or a save_to_disk folder of it")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tasks = parse_ruler_tasks(self.tasks)
        self.budgets = parse_budgets(self.budgets)
        self.lengths = parse_numbers(self.lengths, "lengths", int)
        self.depths = parse_numbers(self.depths, "depths", float)
        for n in self.lengths:
            _at_least(n, "--lengths", 16)
        for d in self.depths:
            if not 0.0 <= d <= 100.0:
                raise EvalError(f"--depths must lie in [0, 100] %, got {d:g}")
        _at_least(self.limit, "--limit")
        _at_least(self.max_new_tokens, "--max-new-tokens")
        check_qa(self)

    def run(self, load: Loader | None = None) -> EvalOutput:
        from kvgate.eval.commands import run_ruler

        return run_ruler(self, load)

    def settings(self) -> dict[str, Any]:
        # --limit only selects (example s is the same at any limit); the mode is in the key
        return {**super().settings(), "seed": self.seed, "depths": self.depths,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware), "source": self.source,
                "score": self.score}


@dataclass
class LongBenchConfig(EvalConfig):
    """LongBench tasks with LongBench's metrics (kvgate.eval.longbench), question asked after
    compression (Bai et al., arXiv:2308.14508)."""

    tasks: str | list[str] = opt("en", "comma-separated LongBench tasks (hotpotqa, qasper-e for "
                                 "LongBench-E, ...) and groups: en (the 16 English and code "
                                 "tasks), zh, e (the 13 LongBench-E tasks), all")
    source: str = opt("hub", "hub (kvpress's Xnhyacinth/LongBench) or a save_to_disk folder of "
                      "it or of THUDM's layout (one sub-folder per task, or one dataset)")
    limit: int | None = opt(None, "first N examples of each task (default all)")
    budgets: str | list[Budget] = opt("0.5", "comma-separated budgets: kept ratios or token "
                                      "counts")
    max_length: int | None = opt(None, "cut a context of more tokens in the middle, keeping its "
                                 "first and last N/2 (LongBench's cut; default none: a prompt "
                                 "longer than the model's context is refused)")
    query_aware: bool = opt(False, "prefill context and question together under the policy "
                            "(key mode query-aware) instead of asking after compression")
    chat: bool = opt(True, "plain prompts even when the tokenizer has a chat template (trec, "
                     "triviaqa, samsum, lsht, lcc, repobench-p always are)")
    max_new_tokens: int | None = opt(None, "cap on LongBench's tokens to generate per task "
                                     "(32 to 512)")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()

    def __post_init__(self) -> None:
        from kvgate.eval.longbench.scoring import LongBenchError, task_names

        super().__post_init__()
        try:
            self.tasks = task_names(_items(self.tasks))
        except LongBenchError as exc:
            raise EvalError(f"--tasks: {exc}") from None
        if not str(self.source).strip():
            raise EvalError("--source: give hub or a save_to_disk folder")
        self.budgets = parse_budgets(self.budgets)
        _at_least(self.limit, "--limit")
        _at_least(self.max_length, "--max-length", 2)
        _at_least(self.max_new_tokens, "--max-new-tokens")
        check_qa(self)

    def run(self, load: Loader | None = None) -> EvalOutput:
        from kvgate.eval.commands import run_longbench

        return run_longbench(self, load)

    def settings(self) -> dict[str, Any]:
        # --limit only selects (the first N of each task); the mode is in the key
        return {**super().settings(), "source": self.source, "max_length": self.max_length,
                "chat": bool(self.chat), "max_new_tokens": self.max_new_tokens,
                "query_aware": bool(self.query_aware), "score": self.score}
