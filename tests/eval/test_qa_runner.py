"""The question-answering runner (``kvgate.eval.runner``): the records it stores for RULER
and the needle equal those stored before it existed (``data/qa_records.json``)."""

from __future__ import annotations

import json

from qa_records import SNAPSHOT, records


def test_ruler_and_needle_records_equal_the_records_before_the_runner(tmp_path):
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(records(tmp_path)))  # as the store writes it
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key
