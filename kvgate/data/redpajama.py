"""The paper's CPT corpus: 4,997 documents of RedPajama-Data-1T-Sample, streamed from the Hub.

The Attention-Gate paper continues pre-training on "4,997 samples drawn proportionally from
each subset of RedPajama". The Hub sample (``togethercomputer/RedPajama-Data-1T-Sample``, ~1B
tokens) keeps one JSON-lines file per subset (arxiv, book, c4, five Common Crawl dumps, github,
stackexchange, wikipedia); its loading script no longer runs under ``datasets`` >= 4, so each
file is streamed with the ``json`` builder instead.

Draw: the ``n`` documents are shared out over the files in proportion to their sizes in bytes
(a subset's share of the sample's text, i.e. the RedPajama mixture), by largest remainders.
From each file the quota is taken from a seeded shuffle buffer of 256 rows over its stream
(streaming cannot shuffle a whole file), with a 5 % surplus that covers documents dropped by
the evaluation-overlap filter of :mod:`kvgate.data.corpus`. The result is cached in
``$KVGATE_CACHE/data``, so only the first call needs the network; offline, that first call fails
in seconds with :class:`~kvgate.data.errors.HubUnavailableError`.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvgate.data.cache import data_cache_dir, read_json, write_json_atomic
from kvgate.data.corpus import filter_eval_overlap, proportional_quotas
from kvgate.data.errors import DataError
from kvgate.data.hub import hub_endpoint, load_hub_dataset, require_hub

REPO = "togethercomputer/RedPajama-Data-1T-Sample"
OFFLINE_HINT = "the embedded corpus, kvgate.data.load_corpus(), needs no network"
PAPER_SAMPLES = 4997
SHUFFLE_BUFFER = 256
SURPLUS = 0.05


def subset_of(filename: str) -> str:
    """RedPajama subset of a sample file: ``cc_2020-05_sample.jsonl`` -> ``common_crawl``."""
    stem = filename.rsplit("/", 1)[-1].removesuffix(".jsonl").removesuffix("_sample")
    return "common_crawl" if stem.startswith("cc_") else stem


def _cache_path(n: int, seed: int) -> Path:
    return data_cache_dir() / f"redpajama-sample-n{n}-seed{seed}.json"


def sample_file_sizes() -> dict[str, int]:
    """Bytes per JSON-lines file of the Hub sample, by file name (needs the network)."""
    from huggingface_hub import HfApi

    try:
        tree = HfApi(endpoint=hub_endpoint()).list_repo_tree(REPO, repo_type="dataset")
        sizes = {f.path: int(f.size) for f in tree if f.path.endswith(".jsonl")}
    except Exception as err:
        raise DataError(f"could not list the files of {REPO}: {type(err).__name__}: "
                        f"{(str(err).splitlines() or [''])[0]}") from err
    if not sizes:
        raise DataError(f"{REPO} lists no .jsonl files; its layout changed")
    return dict(sorted(sizes.items()))


def _stream_file(filename: str, count: int, seed: int) -> list[str]:
    stream = load_hub_dataset("json", data_files=f"hf://datasets/{REPO}/{filename}",
                              split="train", streaming=True, hint=OFFLINE_HINT)
    stream = stream.shuffle(seed=seed, buffer_size=SHUFFLE_BUFFER)
    return [row["text"] for row in stream.take(count) if row.get("text", "").strip()]


def load_redpajama_sample(n: int = PAPER_SAMPLES, seed: int = 0) -> list[str]:
    """``n`` documents drawn as described above, in file order."""
    return [text for _, text in redpajama_sample_records(n, seed)]


def redpajama_sample_records(n: int = PAPER_SAMPLES, seed: int = 0) -> list[tuple[str, str]]:
    """Like :func:`load_redpajama_sample`, as ``(subset, text)`` pairs."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DataError(f"n must be an integer >= 1, got {n!r}")
    cached = read_json(_cache_path(n, seed))
    if isinstance(cached, list):
        return [(str(src), str(text)) for src, text in cached]
    require_hub(f"RedPajama sample ({REPO})", OFFLINE_HINT)
    quotas = proportional_quotas(sample_file_sizes(), n)
    docs: list[tuple[str, str]] = []
    for filename, quota in quotas.items():
        if quota == 0:
            continue
        drawn = _stream_file(filename, quota + math.ceil(quota * SURPLUS) + 2, seed)
        kept = filter_eval_overlap(drawn)[:quota]
        docs.extend((subset_of(filename), text) for text in kept)
    write_json_atomic(_cache_path(n, seed), docs)
    return docs
