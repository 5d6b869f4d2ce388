"""RULER-style long-context tasks generated offline, and RULER's scoring."""

from kvgate.eval.benchmarks.ruler.haystack import RulerError
from kvgate.eval.benchmarks.ruler.scoring import score, string_match_all, string_match_part
from kvgate.eval.benchmarks.ruler.tasks import SCORING, TASKS, RulerExample, generate

__all__ = ["SCORING", "TASKS", "RulerError", "RulerExample", "generate", "score",
           "string_match_all", "string_match_part"]
