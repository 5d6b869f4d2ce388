"""LongBench's scores, from the metric definitions of its evaluation (Bai et al., "LongBench: A
Bilingual, Multitask Benchmark for Long Context Understanding", arXiv:2308.14508).

Each metric compares one prediction with one reference and returns a value in [0, 1]; an
example scores the best value over its references, times 100 (:func:`score_example`). The
metric of each task (:data:`TASK_METRIC`; a LongBench-E task ``NAME-e`` uses NAME's):

- ``qa_f1``: F1 of the words both share, after LongBench's answer normalisation (lower case, no
  ASCII punctuation, no articles a/an/the, single spaces);
- ``qa_f1_zh``: the same F1 over characters, each lower-cased and stripped of Chinese and ASCII
  punctuation and of white space. LongBench cuts Chinese into words with jieba; kvgate has no
  word segmenter, so every character is a token and the zh numbers are character-level, not
  LongBench's own;
- ``rouge``: ROUGE-L F as the ``rouge`` package computes it, which LongBench calls: both texts
  are cut into sentences at ``.``, a sentence into words at spaces; the hits are the distinct
  reference words on the longest common subsequence of any (reference sentence, predicted
  sentence) pair, divided by the distinct words of the reference (recall) and of the
  prediction (precision); F = 2PR / (P + R + 1e-8). An empty text scores 0;
- ``rouge_zh``: ``rouge`` over characters joined by spaces (LongBench: jieba words);
- ``classification``: the class names of ``all_classes`` found in the prediction, less those
  contained in (but not equal to) the reference, give 1/count when the reference is among them
  (LongBench's loop skips the name right after one it drops; so does this one, so the numbers
  agree). Without ``all_classes`` (a dataset copy lacking them), 1 when the reference occurs in
  the prediction, else 0;
- ``retrieval`` / ``retrieval_zh``: the paragraph number of the reference ("Paragraph 3",
  "段落3") against every number in the prediction: the share of them that equal it (a reference
  without that phrase uses its first number);
- ``count``: the share of the numbers in the prediction that equal the reference;
- ``code_sim``: the prediction's first line without a backtick, ``#`` or ``//`` (after
  leading new lines), against the reference by fuzzywuzzy's ``fuzz.ratio`` / 100: the
  Levenshtein ratio (len(a) + len(b) - d) / (len(a) + len(b)), where d is the edit distance
  with substitutions costing 2, in whole percent (:func:`fuzz_ratio`).

On the few-shot tasks (trec, triviaqa, samsum, lsht) only the prediction's first line, after
leading new lines, is scored, as LongBench does (:data:`FIRST_LINE_TASKS`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

from kvgate.data.longctx import LONGBENCH_E_TASKS, LONGBENCH_TASKS
from kvgate.errors import KVGateError


class LongBenchError(KVGateError, ValueError):
    """A LongBench task or setting that cannot be scored as asked."""


TASK_METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh", "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1",
    "dureader": "rouge_zh", "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge",
    "vcsum": "rouge_zh", "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge",
    "lsht": "classification", "passage_count": "count", "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh", "lcc": "code_sim", "repobench-p": "code_sim",
}
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
ZH_TASKS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
# --tasks groups: the English (and code) tasks, the Chinese ones, LongBench-E, all 21
TASK_GROUPS = {
    "en": tuple(t for t in LONGBENCH_TASKS if t not in ZH_TASKS),
    "zh": ZH_TASKS,
    "e": tuple(f"{t}-e" for t in LONGBENCH_E_TASKS),
    "all": LONGBENCH_TASKS,
}

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCT = frozenset(string.punctuation)
# the Chinese punctuation LongBench strips besides ASCII's (full-width forms, CJK brackets,
# dashes, curly quotes, the ellipsis); it lists the closing 》 but not the opening 《
_ZH_PUNCT = _ASCII_PUNCT | frozenset(
    "！＂＃＄％＆＇（）＊＋，－／：；＜＝＞？＠［＼］＾＿｀｛｜｝～｟｠｡｢｣､"
    "、。〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏")


def base_task(task: str) -> str:
    """The LongBench task of a name (``hotpotqa-e`` -> ``hotpotqa``); LongBenchError if unknown."""
    base = task.removesuffix("-e")
    if base not in TASK_METRIC or (task.endswith("-e") and base not in LONGBENCH_E_TASKS):
        raise LongBenchError(f"unknown LongBench task {task!r}; known: "
                             f"{', '.join(LONGBENCH_TASKS)}, NAME-e for LongBench-E "
                             f"({', '.join(LONGBENCH_E_TASKS)}), or the groups "
                             f"{', '.join(TASK_GROUPS)}")
    return base


def task_names(names: Sequence[str]) -> list[str]:
    """Task names and groups (``en``, ``zh``, ``e``, ``all``) -> task names, each once, in order."""
    out: list[str] = []
    for name in names:
        for task in TASK_GROUPS.get(name, (name,)):
            base_task(task)
            if task not in out:
                out.append(task)
    if not out:
        raise LongBenchError("give at least one LongBench task or group")
    return out


# ---------------------------------------------------------------------------------------------
# the metrics: (prediction, reference) -> [0, 1]


def normalize_answer(text: str) -> str:
    """Lower case, ASCII punctuation dropped, articles dropped, white space collapsed."""
    text = "".join(c for c in text.lower() if c not in _ASCII_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _zh_char(char: str) -> str:
    return "".join(c for c in char.lower() if c not in _ZH_PUNCT and not c.isspace())


def f1(pred: Sequence[str], ref: Sequence[str]) -> float:
    """F1 of the tokens the two share (as multisets)."""
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    return f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh_score(prediction: str, reference: str) -> float:
    """F1 over characters (LongBench: over jieba words, see the module docstring)."""
    pred = [t for t in map(_zh_char, prediction) if t]
    ref = [t for t in map(_zh_char, reference) if t]
    return f1(pred, ref)


def _sentences(text: str) -> list[list[str]]:
    """The ``rouge`` package's cut: sentences at '.', white space collapsed, words at ' '."""
    return [" ".join(part.split()).split(" ") for part in text.split(".") if part]


def lcs_words(ref: Sequence[str], hyp: Sequence[str]) -> set[str]:
    """The words of the longest common subsequence of ``ref`` and ``hyp`` that the ``rouge``
    package reconstructs: walking back from the ends, a match is taken; otherwise the walk
    drops a word of ``ref`` only when that keeps a strictly longer subsequence, else one of
    ``hyp``."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, above = table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = above[j - 1] + 1 if ref[i - 1] == hyp[j - 1] else max(above[j], row[j - 1])
    words: set[str] = set()
    i, j = n, m
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_score(prediction: str, reference: str) -> float:
    """ROUGE-L F (summary level, the ``rouge`` package's; see the module docstring)."""
    hyp, ref = _sentences(prediction), _sentences(reference)
    if not hyp or not ref:
        return 0.0
    hits: set[str] = set()
    for r in ref:
        for h in hyp:
            hits |= lcs_words(r, h)
    recall = len(hits) / len({w for s in ref for w in s})
    precision = len(hits) / len({w for s in hyp for w in s})
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge_zh_score(prediction: str, reference: str) -> float:
    """ROUGE-L F over characters (LongBench: over jieba words)."""
    return rouge_score(" ".join(prediction), " ".join(reference))


def classification_score(prediction: str, reference: str,
                         classes: Sequence[str] | None = None) -> float:
    """LongBench's class matching (see the module docstring)."""
    if not classes:
        return 1.0 if reference in prediction else 0.0
    found = [c for c in classes if c in prediction]
    i = 0
    while i < len(found):
        if found[i] != reference and found[i] in reference:
            del found[i]  # and, as LongBench's loop, the next name is not looked at
        i += 1
    return 1.0 / len(found) if reference in found else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, reference: str) -> float:
    return _share_equal(prediction, str(reference))


def _paragraph(reference: str, pattern: str) -> str | None:
    found = re.findall(pattern, reference) or re.findall(r"\d+", reference)
    return found[0] if found else None


def retrieval_score(prediction: str, reference: str) -> float:
    target = _paragraph(reference, r"Paragraph (\d+)")
    return 0.0 if target is None else _share_equal(prediction, target)


def retrieval_zh_score(prediction: str, reference: str) -> float:
    target = _paragraph(reference, r"段落(\d+)")
    return 0.0 if target is None else _share_equal(prediction, target)


def indel_distance(a: str, b: str) -> int:
    """Edit distance where insertions and deletions cost 1 and substitutions 2."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (0 if ca == cb else 2))
        prev = cur
    return prev[-1]


def levenshtein_ratio(a: str, b: str) -> float:
    """python-Levenshtein's ``ratio``: (len(a) + len(b) - d) / (len(a) + len(b))."""
    total = len(a) + len(b)
    return 1.0 if total == 0 else (total - indel_distance(a, b)) / total


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio``: equal texts 100, an empty one 0, else the Levenshtein
    ratio in whole percent (Python's round)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * levenshtein_ratio(a, b))


def first_code_line(prediction: str) -> str:
    """The first line that holds no backtick, ``#`` or ``//`` ('' when none does)."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, reference: str) -> float:
    return fuzz_ratio(first_code_line(prediction), reference) / 100


METRICS: dict[str, Callable[[str, str], float]] = {
    "qa_f1": qa_f1_score, "qa_f1_zh": qa_f1_zh_score, "rouge": rouge_score,
    "rouge_zh": rouge_zh_score, "classification": classification_score,
    "retrieval": retrieval_score, "retrieval_zh": retrieval_zh_score, "count": count_score,
    "code_sim": code_sim_score,
}


def first_line(prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0]


def score_example(task: str, prediction: str, answers: Sequence[str],
                  all_classes: Sequence[str] | None = None) -> float:
    """One example's LongBench score in %: the task's metric, best over ``answers``."""
    base = base_task(task)
    if base in FIRST_LINE_TASKS:
        prediction = first_line(prediction)
    metric = TASK_METRIC[base]
    best = 0.0
    for reference in answers:
        if metric == "classification":
            value = classification_score(prediction, reference, all_classes)
        else:
            value = METRICS[metric](prediction, reference)
        best = max(best, value)
    return 100.0 * best
