"""Before / after: ``kvgate eval ruler``, ``eval mc`` and ``eval ppl`` on gated exports of a
tiny model (attention, mlp and linear gates, each exported and read back by ``--checkpoint``)
store the per-example records they stored before the gate kinds got a config each (#63) and
``previous_layer`` went (#62), timings left out. RULER's run of the attention export also
covers the one-shot policies' shared prefill and KVzip's shared passes.

Regenerate ``data/gate_records.json`` (only when a change of the numbers is intended, and say
why in the commit): ``python tests/eval/gate_records.py``."""

from __future__ import annotations

import json

import pytest
from gate_records import SNAPSHOT, records


def same(got, want, where: str) -> None:
    """``got == want``, floats to 1e-6 relative (the sums run in another thread count)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def test_eval_records_of_gated_exports_equal_the_recorded_ones(tmp_path):
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(records(tmp_path)))  # as the store writes it
    assert sorted(got) == sorted(want)
    for key in want:
        same(got[key], want[key], key)
