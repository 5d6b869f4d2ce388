"""CPT corpus: filtering rules, caching, sampling, the leak check, local files."""

from __future__ import annotations

import json
import random

import pytest

from kvgate.data import (
    TASKS,
    DataError,
    corpus_sources,
    corpus_token_count,
    embedded_splits,
    load_corpus,
    load_task,
    load_text_files,
)
from kvgate.data import corpus as corpus_mod
from kvgate.data.overlap import NGRAM, NgramIndex, words

LOREM = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray"]


def _text(start: int, count: int) -> str:
    return " ".join(LOREM[start:start + count])


def test_ngram_rule_boundaries():
    index = NgramIndex([_text(0, 20)])
    flags = index.overlaps([
        "Zulu " + _text(3, 13).upper() + "!",  # 13 shared words, other case and punctuation
        _text(3, 12),                          # only 12 shared words
        _text(0, 6) + " zulu " + _text(6, 7),  # 13 words, but broken by an extra word
        "",
    ])
    assert flags.tolist() == [True, False, False, False]
    # n-grams never span two reference texts
    split_ref = NgramIndex([_text(0, 7), _text(7, 7)])
    assert not split_ref.overlaps([_text(0, 14)])[0]


def test_build_drops_short_duplicate_and_leaking_docs():
    leak_source = "the quick brown fox jumps over the lazy dog near the river bank today"
    raw = {
        "a": [_text(0, 20), "  " + _text(0, 20).upper() + "  ", "too short to keep"],
        "b": [_text(2, 20), "Intro words. " + leak_source + " More words follow here."],
    }
    docs, stats = corpus_mod.build_corpus(raw, reference=["Q: " + leak_source + "?"])
    assert [d[0] for d in docs] == ["a", "b"]
    assert stats["a"]["duplicate"] == 1 and stats["a"]["short"] == 1
    assert stats["b"]["eval_overlap"] == 1 and stats["b"]["kept"] == 1
    assert stats["a"]["words"] == 20


def test_cache_is_built_once_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))
    calls = []

    def fake_source():
        calls.append(1)
        return [_text(i, 15) for i in range(6)]

    monkeypatch.setattr(corpus_mod, "SOURCES", {"fake": fake_source})
    monkeypatch.setattr(corpus_mod, "eval_reference_texts", lambda n=NGRAM: [_text(0, 13)])
    corpus_mod._processed.cache_clear()
    try:
        docs = load_corpus()
        assert len(docs) == 5 and corpus_sources() == {"fake": 5}
        files = list((tmp_path / "data").iterdir())
        assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left over
        corpus_mod._processed.cache_clear()
        assert load_corpus() == docs and len(calls) == 1  # read back from disk
        files[0].write_text("{truncated")  # a damaged cache is rebuilt
        corpus_mod._processed.cache_clear()
        assert load_corpus() == docs and len(calls) == 2
    finally:
        corpus_mod._processed.cache_clear()


def test_select_docs_is_seeded_and_proportional():
    docs = [("a", f"a{i}", f"text a{i}") for i in range(60)] + \
           [("b", f"b{i}", f"text b{i}") for i in range(30)] + [("c", "c0", "text c0")]
    first = corpus_mod.select_docs(docs, None, seed=0)
    assert sorted(first) == sorted(docs) and first == corpus_mod.select_docs(docs, None, 0)
    assert first != corpus_mod.select_docs(docs, None, seed=1)
    part = corpus_mod.select_docs(docs, 30, seed=0)
    counts = {s: sum(d[0] == s for d in part) for s in "abc"}
    assert counts == {"a": 20, "b": 10, "c": 0}
    with pytest.raises(DataError, match="max_docs"):
        corpus_mod.select_docs(docs, -1, seed=0)


# --- the real embedded corpus (built once into $KVGATE_CACHE, ~15 s of CPU the first time) ---

@pytest.fixture(scope="module")
def real_corpus():
    return corpus_mod.processed_corpus()


def test_real_corpus_mix(real_corpus):
    sources = corpus_sources()
    assert set(sources) == set(corpus_mod.SOURCES) and all(n > 0 for n in sources.values())
    docs = load_corpus()
    assert len(docs) == sum(sources.values()) == len(real_corpus["docs"])
    assert len({" ".join(d.lower().split()) for d in docs}) == len(docs)  # exact dedup
    subset = load_corpus(max_docs=500)
    assert len(subset) == 500 and subset == load_corpus(max_docs=500)
    assert set(subset) <= set(docs)


def test_real_corpus_shares_no_13gram_with_eval_text(real_corpus):
    # Independent of NgramIndex's hashing: plain sets of word tuples. Corpus side: a stratified
    # sample of 20 docs per source; evaluation side: every example of every shipped split.
    rng = random.Random(0)
    by_source: dict[str, list[str]] = {}
    for src, _, text in real_corpus["docs"]:
        by_source.setdefault(src, []).append(text)
    grams: set[tuple[bytes, ...]] = set()
    for texts in by_source.values():
        for text in rng.sample(texts, min(20, len(texts))):
            grams.update(_ngrams(text))
    assert len(grams) > 10_000
    for task in TASKS:
        for split in embedded_splits(task):
            for ex in load_task(task, split):
                others = [c for i, c in enumerate(ex.choices) if i != ex.gold]
                for text in (ex.context + ex.choices[ex.gold], *others):
                    w = words(text)
                    # isdisjoint consumes the n-gram iterator lazily and stops at a hit
                    assert grams.isdisjoint(zip(*(w[k:] for k in range(NGRAM)))), \
                        f"{ex.uid} overlaps the corpus"


def _ngrams(text: str) -> set[tuple[bytes, ...]]:
    w = words(text)
    return set(zip(*(w[k:] for k in range(NGRAM))))


def test_real_corpus_drops_a_known_leak(real_corpus):
    # a CoQA story is the same Wikipedia text as a BoolQ passage; it must have been filtered
    marker = "It is a peninsula, bordered on the north and east by the state of New York"
    assert any(marker in ex.context for ex in load_task("boolq"))
    assert not any(marker in text for _, _, text in real_corpus["docs"])
    assert real_corpus["stats"]["coqa"]["eval_overlap"] >= 1


def test_token_count_with_a_whitespace_tokenizer():
    def tokenizer(batch, add_special_tokens=False, verbose=False):
        return {"input_ids": [t.split() for t in batch]}

    texts = ["a b c", "d e", "f"] * 100
    assert corpus_token_count(tokenizer, texts, batch_size=7) == 600


def test_load_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("  first document \n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": " third ", "id": 3}) + "\n")
    (tmp_path / "empty.txt").write_text("   ")
    assert load_text_files([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "empty.txt"]) \
        == ["first document", "second", "third"]
    assert load_text_files(str(tmp_path / "a.txt")) == ["first document"]


@pytest.mark.parametrize("name,content,pattern", [
    ("missing.txt", None, "does not exist"),
    ("bad.jsonl", '{"text": "ok"}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
    ("notext.jsonl", '{"body": "x"}\n', r"notext.jsonl:1: no string field 'text'"),
    ("data.csv", "a,b\n", "unsupported file type '.csv'"),
])
def test_load_text_files_errors(tmp_path, name, content, pattern):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=pattern):
        load_text_files([tmp_path / name])
