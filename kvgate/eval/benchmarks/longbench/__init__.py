"""LongBench under eviction (Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long
Context Understanding", arXiv:2308.14508): its metrics (:mod:`.scoring`), the question-agnostic
run (:mod:`.run`, ``evaluate_longbench``) and its tables and plot (:mod:`.report`)."""

from kvgate.eval.benchmarks.longbench.scoring import (
    TASK_GROUPS,
    TASK_METRIC,
    LongBenchError,
    score_example,
    task_names,
)

__all__ = ["TASK_GROUPS", "TASK_METRIC", "LongBenchError", "score_example", "task_names"]
