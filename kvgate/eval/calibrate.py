"""``kvgate eval calibrate``: a learned gate's threshold (tau) per context length for target
eviction ratios, on held-out contexts (:mod:`kvgate.inference.calibrate`).

The contexts are RULER-style haystacks of ``--tasks`` (generated from ``--seed``, by default
1000 on, away from the seeds ``eval ruler`` scores: 0 on) or the first ``length`` tokens of
``--text-files``. Writes ``OUT/calibration.json`` and ``.md`` (each written whole) and prints
the table with the flag that dials each threshold; its progress counts compressions of a
context (``kvgate.inference.calibrate``; ``--quiet`` leaves it out)::

    kvgate eval calibrate --checkpoint runs/cpt_kvzap/gated --policies local_gate \\
        --evict 0.25,0.5,0.75 --lengths 1024,2048,4096 --out out/cal

No ``--kv-bits`` other than 16: a gate's choice is made at the prefill, over the keys and values
the prompt computes before any entry is stored, so the share it evicts is the same whatever the
cache stores them in (``tests/inference/test_kv_bits.py`` checks this of every gate); a
threshold calibrated here serves a cache at 8 or 4 bits as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from kvgate.eval.benchmarks.ruler.config import parse_ruler_tasks
from kvgate.eval.config import EvalConfig, _at_least, parse_numbers
from kvgate.eval.errors import EvalError
from kvgate.eval.options import opt
from kvgate.policies.base import PolicyError


@dataclass
class CalibrateConfig(EvalConfig):
    """A gate's threshold per context length for target eviction ratios (no scoring)."""

    policies: str | list[str] = opt("attention_gate", "comma-separated learned-gate policies "
                                    "(attention_gate, local_gate; LABEL=NAME too)")
    evict: str | list[float] = opt("0.25,0.5,0.75", "target shares of context entries evicted, "
                                   "each in (0, 1)")
    lengths: str | list[int] = opt("1024,2048,4096", "context lengths in tokens")
    tasks: str | list[str] = opt("niah_single_2", "RULER tasks whose haystacks are the contexts "
                                 "(niah_single_2: natural passages)")
    limit: int = opt(4, "contexts per (task, length)")
    seed: int = opt(1000, "seed of the first generated context")
    text_files: list[str] | None = opt(None, "use the first LENGTH tokens of these .txt/.jsonl "
                                       "texts instead of generated haystacks", nargs="*")
    tol: float = opt(0.01, "stop when the measured share is this close to the target")
    max_runs: int = opt(10, "compressions of every context at most, per target")
    chat: bool = opt(True, "plain prompts even when the tokenizer has a chat template")
    kv_bits: int = opt(16, "16 only: a gate chooses at the prefill, over the prompt's keys and "
                       "values before any is stored, so the share it evicts, and the "
                       "threshold found, are the same at --kv-bits 8 or 4")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_bits != 16:
            raise EvalError(f"--kv-bits {self.kv_bits}: calibrate measures the share a gate "
                            "evicts, chosen at the prefill before any entry is stored, so it "
                            "is the same at any --kv-bits: calibrate at 16 and serve the "
                            "threshold at 8 or 4")
        self.evict = parse_numbers(self.evict, "evict", float)
        for e in self.evict:
            if not 0.0 < e < 1.0:
                raise EvalError(f"--evict: each target must lie in (0, 1), got {e:g}")
        self.lengths = parse_numbers(self.lengths, "lengths", int)
        for n in self.lengths:
            _at_least(n, "--lengths", 16)
        self.tasks = parse_ruler_tasks(self.tasks, allow_all=False)
        _at_least(self.limit, "--limit")
        _at_least(self.max_runs, "--max-runs")
        if not 0.0 < self.tol < 1.0:
            raise EvalError(f"--tol must lie in (0, 1), got {self.tol:g}")
        if self.all_policies:
            raise EvalError("--policies: name the gate policies to calibrate (all is for scoring)")
        from kvgate.inference.calibrate import with_tau

        for label, policy in self.build_policies().items():
            try:
                with_tau(policy, 0.5)
            except PolicyError as exc:
                raise EvalError(f"--policies {label}: {exc}") from None
        if self.text_files:  # a missing, malformed or non-UTF-8 file: one line before loading
            from kvgate.data import load_text_files

            load_text_files(self.text_files)


@dataclass
class CalibrationOutput:
    rows: list[dict[str, Any]]
    paths: list[Path]

    def table(self) -> str:
        return calibration_markdown(self.rows)


class TokenRows:
    """The ``--text-files`` texts' token ids in order, each text tokenised once and only when a
    length first reaches it: a long .jsonl with a small ``--limit`` is not tokenised in full,
    and a second length reads again what the first tokenised."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts
        self.done: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        for i, text in enumerate(self.texts):
            if i == len(self.done):
                self.done.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            yield self.done[i]


def contexts(cfg: CalibrateConfig, tokenizer: Any, length: int,
             rows: Iterable[list[int]] | None = None) -> list[str]:
    """The calibration contexts of one length: from ``rows`` (the ``--text-files`` texts'
    token ids, ``TokenRows``) or generated."""
    if rows is not None:
        # decode only the first --limit texts long enough, not every one
        out = [tokenizer.decode(ids[:length])
               for ids in islice((ids for ids in rows if len(ids) >= length), cfg.limit)]
        if not out:
            raise EvalError(f"--text-files: no text has {length:,} tokens; use shorter --lengths")
        return out
    from kvgate.eval.benchmarks.ruler.tasks import generate

    return [generate(task, tokenizer, length, seed=cfg.seed + s).context
            for task in cfg.tasks for s in range(cfg.limit)]


def run_calibrate(cfg: CalibrateConfig, load: Any = None) -> CalibrationOutput:
    from kvgate.data.cache import write_atomic, write_json_atomic
    from kvgate.eval.commands import load_checked
    from kvgate.inference.calibrate import calibrate
    from kvgate.progress import Progress

    model, tokenizer, policies, meta = load_checked(cfg, load, cfg.build_policies())
    tokenised = None
    if cfg.text_files:
        from kvgate.data import load_text_files

        tokenised = TokenRows(tokenizer, load_text_files(cfg.text_files))
    rows = []
    # compressions at most: every context, max_runs times a target; fewer texts than asked and
    # searches that end early leave the total as they are found
    asked = cfg.limit * (1 if cfg.text_files else len(cfg.tasks))
    per_context = len(set(cfg.evict)) * cfg.max_runs * len(policies)
    with Progress(len(cfg.lengths) * asked * per_context, "calibrate", "compression",
                  quiet=not cfg.progress) as bar:
        for length in cfg.lengths:
            texts = contexts(cfg, tokenizer, length, tokenised)
            bar.drop((asked - len(texts)) * per_context)
            for label, policy in policies.items():
                fits = calibrate(model, tokenizer, policy, texts, cfg.evict, cfg.tol,
                                 cfg.max_runs, cfg.chat, bar)
                rows += [{"policy": label, "length": length, "target": f.target, "tau": f.tau,
                          "evicted": f.evicted, "runs": f.runs, "reached": f.reached,
                          "contexts": len(texts)} for f in fits]
    out = Path(cfg.out)
    json_path, md_path = out / "calibration.json", out / "calibration.md"
    settings = {**cfg.settings(), "tasks": None if cfg.text_files else cfg.tasks,
                "text_files": cfg.text_files, "seed": cfg.seed, "limit": cfg.limit,
                "tol": cfg.tol, "chat": bool(cfg.chat)}
    write_json_atomic(json_path, {"meta": meta, "settings": settings, "fits": rows})
    table = calibration_markdown(rows)
    write_atomic(md_path, lambda tmp: Path(tmp).write_text(table + "\n", encoding="utf-8"))
    return CalibrationOutput(rows, [json_path, md_path])


def calibration_markdown(rows: list[dict[str, Any]]) -> str:
    """One row per (policy, length, target): the threshold, the share it evicts and the flag
    that dials it (a share off by more than the tolerance is marked not reached)."""
    lines = ["| policy | length | target %Evict | tau | %Evict at tau | runs | flag |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        note = "" if r["reached"] else " (not reached)"
        lines.append(f"| {r['policy']} | {r['length']} | {100 * r['target']:.1f} | "
                     f"{r['tau']:.4f} | {100 * r['evicted']:.1f}{note} | {r['runs']} | "
                     f"`--policy-opt {r['policy']}.tau={r['tau']:.4f}` |")
    return "\n".join(lines)
