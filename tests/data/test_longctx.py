"""RULER and LongBench loaders, offline: tiny fixtures in the real column layouts, saved to disk."""

from __future__ import annotations

import time

import pytest

from kvgate.data import DataError, HubUnavailableError, LongExample, load_longbench, load_ruler
from kvgate.data import hub as data_hub

datasets = pytest.importorskip("datasets")


def _ruler_rows(tasks=("niah_single_1", "vt", "qa_1", "niah_single_1")):
    # simonjegou/ruler: the reference column is "answer" and holds a list of strings
    return {
        "context": [f"haystack {i} ..." for i in range(len(tasks))],
        "question": [f"What is the value {i}?" for i in range(len(tasks))],
        "answer_prefix": [" Answer:"] * len(tasks),
        "answer": [[f"v{i}", f"w{i}"] for i in range(len(tasks))],
        "task": list(tasks),
        "max_new_tokens": [128, 30, 32, 128][: len(tasks)],
    }


def _kvpress_longbench_rows(task="hotpotqa", n=3):
    return {
        "context": [f"passage {i}" for i in range(n)],
        "question": [f"Question: q{i}" for i in range(n)],
        "answer_prefix": ["Answer:"] * n,
        "answers": [[f"a{i}"] for i in range(n)],
        "task": [task] * n,
        "all_classes": [None] * n,
        "length": [1000 * (i + 1) for i in range(n)],
        "max_new_tokens": [32] * n,
        "_id": [f"id{i}" for i in range(n)],
    }


def _thudm_longbench_rows():
    # THUDM/LongBench: question in "input", task in "dataset", no answer_prefix
    return {
        "input": ["Which class?", "Which class again?", "Count them"],
        "context": ["c0", "c1", "c2"],
        "answers": [["LOC"], ["NUM"], ["3"]],
        "length": [100, 200, 300],
        "dataset": ["trec", "trec", "passage_count"],
        "language": ["en"] * 3,
        "all_classes": [["LOC", "NUM"], ["LOC", "NUM"], None],
        "_id": ["t0", "t1", "p0"],
    }


def _save(rows, path, as_dict=False):
    data = datasets.Dataset.from_dict(rows)
    if as_dict:
        data = datasets.DatasetDict({"test": data})
    data.save_to_disk(str(path))
    return path


def test_ruler_round_trip_per_length_folder(tmp_path):
    _save(_ruler_rows(), tmp_path / "4096", as_dict=True)
    examples = load_ruler(4096, source=tmp_path)
    assert len(examples) == 4 and all(isinstance(e, LongExample) for e in examples)
    first = examples[0]
    assert first.context == "haystack 0 ..." and first.question == "What is the value 0?"
    assert first.answer_prefix == " Answer:" and first.answers == ["v0", "w0"]
    assert first.task == "niah_single_1" and first.length == 4096 and first.max_new_tokens == 128
    assert first.id == "ruler-4096:niah_single_1:0"
    assert len({e.id for e in examples}) == 4


def test_ruler_task_filter_and_limit(tmp_path, capfd):
    path = _save(_ruler_rows(), tmp_path / "ruler4k")  # a plain Dataset, not a per-length folder
    capfd.readouterr()
    assert [e.task for e in load_ruler(4096, tasks="niah_single_1", source=path)] == \
        ["niah_single_1"] * 2
    assert [e.task for e in load_ruler(4096, tasks=["vt", "qa_1"], source=path)] == ["vt", "qa_1"]
    assert [e.answers for e in load_ruler(4096, source=path, limit=2)] == [["v0", "w0"],
                                                                          ["v1", "w1"]]
    assert load_ruler(4096, source=path, limit=0) == []
    assert capfd.readouterr().err == ""  # the task filter draws no progress bar


def test_ruler_accepts_answers_column(tmp_path):
    rows = _ruler_rows()
    rows["answers"] = rows.pop("answer")
    assert load_ruler(4096, source=_save(rows, tmp_path / "r"))[1].answers == ["v1", "w1"]


@pytest.mark.parametrize("call,match", [
    (lambda p: load_ruler(4096, tasks="niah_single_9", source=p), "unknown RULER task.*niah_single_9"),
    (lambda p: load_ruler(5000, source=p), "unknown RULER length 5000.*4096, 8192"),
    (lambda p: load_ruler(8192, source=p), "unknown RULER length '8192' in .*: it holds 4096"),
    (lambda p: load_ruler(4096, source=p, limit=-1), "limit must be"),
    (lambda p: load_ruler(4096, source=p / "nowhere"), "does not exist"),
], ids=["task", "length", "length-missing-locally", "limit", "path"])
def test_ruler_errors_are_one_line(tmp_path, call, match):
    _save(_ruler_rows(), tmp_path / "4096")
    with pytest.raises(DataError, match=match) as info:
        call(tmp_path)
    assert "\n" not in str(info.value)


def test_ruler_missing_column(tmp_path):
    rows = _ruler_rows()
    del rows["answer_prefix"]
    with pytest.raises(DataError, match="missing column.*answer_prefix") as info:
        load_ruler(4096, source=_save(rows, tmp_path / "r"))
    assert "\n" not in str(info.value)


def test_ruler_unknown_task_in_data(tmp_path):
    path = _save(_ruler_rows(tasks=("niah_single_1", "mystery")), tmp_path / "r")
    with pytest.raises(DataError, match="row 1 has unknown task 'mystery'"):
        load_ruler(4096, source=path)


def test_longbench_kvpress_round_trip(tmp_path):
    _save(_kvpress_longbench_rows(), tmp_path / "hotpotqa", as_dict=True)
    examples = load_longbench("hotpotqa", source=tmp_path)
    assert [e.id for e in examples] == ["longbench:hotpotqa:id0", "longbench:hotpotqa:id1",
                                        "longbench:hotpotqa:id2"]
    first = examples[0]
    assert (first.context, first.question, first.answer_prefix, first.answers) == \
        ("passage 0", "Question: q0", "Answer:", ["a0"])
    assert first.task == "hotpotqa" and first.length == 1000 and first.max_new_tokens == 32
    assert first.all_classes is None
    assert len(load_longbench("hotpotqa", source=tmp_path, limit=2)) == 2


def test_longbench_mixed_dataset_filters_by_task(tmp_path):
    rows = _kvpress_longbench_rows("hotpotqa", 2)
    other = _kvpress_longbench_rows("hotpotqa-e", 1)
    merged = {k: rows[k] + other[k] for k in rows}
    path = _save(merged, tmp_path / "mixed")
    assert [e.id for e in load_longbench("hotpotqa", source=path)] == \
        ["longbench:hotpotqa:id0", "longbench:hotpotqa:id1"]
    assert [e.task for e in load_longbench("hotpotqa-e", source=path)] == ["hotpotqa-e"]


def test_longbench_thudm_layout(tmp_path):
    path = _save(_thudm_longbench_rows(), tmp_path / "thudm")
    trec = load_longbench("trec", source=path)
    assert [e.question for e in trec] == ["Which class?", "Which class again?"]
    assert trec[0].answer_prefix == "Answer:" and trec[0].answers == ["LOC"]
    assert trec[0].all_classes == ["LOC", "NUM"] and trec[0].length == 100
    assert trec[0].id == "longbench:trec:t0"
    count = load_longbench("passage_count", source=path)
    assert [(e.answers, e.all_classes) for e in count] == [(["3"], None)]


@pytest.mark.parametrize("task,match", [
    ("hotpot", "unknown LongBench task 'hotpot'"),
    ("musique-e", "unknown LongBench task 'musique-e'"),
])
def test_longbench_bad_task(tmp_path, task, match):
    with pytest.raises(DataError, match=match) as info:
        load_longbench(task, source=tmp_path)
    assert "\n" not in str(info.value)


def test_longbench_missing_columns(tmp_path):
    rows = _kvpress_longbench_rows()
    del rows["answers"]
    with pytest.raises(DataError, match="missing column.*answers"):
        load_longbench("hotpotqa", source=_save(rows, tmp_path / "hotpotqa"))
    rows = _kvpress_longbench_rows()
    del rows["task"]
    with pytest.raises(DataError, match="several tasks.*missing column.*task"):
        load_longbench("hotpotqa", source=_save(rows, tmp_path / "one"))


def test_hub_source_calls_load_dataset_like_kvpress(monkeypatch, tmp_path):
    ruler = datasets.Dataset.from_dict(_ruler_rows())
    bench = datasets.Dataset.from_dict(_kvpress_longbench_rows("qasper-e", 2))
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs.get("data_dir")))
        return ruler if path == "simonjegou/ruler" else bench

    monkeypatch.setattr(data_hub, "hub_offline_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert [e.task for e in load_ruler(8192, tasks="vt")] == ["vt"]
    assert len(load_longbench("qasper-e", limit=1)) == 1
    assert calls == [("simonjegou/ruler", None, "test", "8192"),
                     ("Xnhyacinth/LongBench", None, "test", "qasper-e")]


@pytest.mark.parametrize("call", [
    lambda: load_ruler(4096, source="hub"),
    lambda: load_longbench("hotpotqa", source="hub"),
], ids=["ruler", "longbench"])
def test_hub_offline_fails_fast_in_one_line(monkeypatch, call):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # monkeypatch restores it after the test
    start = time.monotonic()
    with pytest.raises(HubUnavailableError, match="unreachable.*HF_HUB_OFFLINE.*source=<path>") \
            as info:
        call()
    assert time.monotonic() - start < 6
    assert "\n" not in str(info.value)
