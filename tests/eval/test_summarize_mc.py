"""experiments/summarize_mc.py: paired accuracy gaps over shared examples, and pairing across
modes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import load_script

summarize_mc = load_script("experiments/summarize_mc.py")


def record(policy: str, mode: str, hits: list[int], task: str = "rte") -> dict:
    # choice 0 is gold; a hit puts the higher log-likelihood on it
    examples = {f"{task}:{i}": {"task": task, "gold": 0, "ll": [0.0, -1.0] if h else [-1.0, 0.0]}
                for i, h in enumerate(hits)}
    acc = 100 * sum(hits) / len(hits)
    return {"kind": "mc", "task": task, "policy": policy, "budget": "none", "mode": mode,
            "n": len(hits), "acc": acc, "acc_norm": acc, "evict_pct": 0.0, "complete": True,
            "examples": examples}


def summarize(tmp_path: Path, monkeypatch, capsys, *extra: str) -> dict[str, str]:
    recs = {"full": record("full", "masked", [1, 1, 1, 1]),
            "h2o": record("h2o", "masked", [1, 0, 1, 1]),
            "roco": record("roco", "cache", [1, 0, 0, 1])}
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"meta": {}, "results": recs}))
    monkeypatch.setattr(sys, "argv", ["summarize_mc.py", str(out), "--paired", "full", *extra])
    summarize_mc.main()
    text = capsys.readouterr().out
    rows = [line.split("|") for line in text.splitlines()[2:]]
    return {cells[3].strip(): cells[-2].strip() for cells in rows}


def test_gap_is_reference_minus_policy_on_shared_examples(tmp_path, monkeypatch, capsys):
    gaps = summarize(tmp_path, monkeypatch, capsys)
    assert gaps["h2o"].startswith("+25.00") and gaps["h2o"].endswith("(n=4)")
    assert gaps["roco"] == ""  # the full cache ran in masked mode only


def test_any_mode_pairs_with_the_reference_of_the_other_mode(tmp_path, monkeypatch, capsys):
    gaps = summarize(tmp_path, monkeypatch, capsys, "--any-mode")
    assert gaps["roco"].startswith("+50.00") and gaps["roco"].endswith("(n=4)")
    assert gaps["h2o"].startswith("+25.00")


def test_folder_prefix_pairs_two_gates_from_two_folders(tmp_path, monkeypatch, capsys):
    for name, hits in (("a", [1, 1, 1, 0]), ("b", [1, 0, 0, 0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"meta": {}, "results": {"g": record("attention_gate", "masked", hits)}}))
    monkeypatch.setattr(sys, "argv", ["summarize_mc.py", str(tmp_path / "a"), str(tmp_path / "b"),
                                      "--paired", "a:attention_gate"])
    summarize_mc.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    gaps = {cells[1].strip(): cells[-2].strip() for cells in rows}
    assert gaps["a"] == "" and gaps["b"].startswith("+50.00") and gaps["b"].endswith("(n=4)")


def test_merge_pools_a_run_split_over_folders_by_task(tmp_path, monkeypatch, capsys):
    halves = {"a": ("rte", [1, 1, 1, 1], [1, 0, 1, 1]), "b": ("copa", [1, 1, 0, 1], [0, 0, 0, 1])}
    for name, (task, gate, h2o) in halves.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"meta": {}, "results": {
            "g": record("attention_gate", "masked", gate, task),
            "h": record("h2o", "masked", h2o, task)}}))
    folders = [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "a")]  # "a" twice
    monkeypatch.setattr(sys, "argv", ["summarize_mc.py", *folders, "--paired", "attention_gate",
                                      "--merge"])
    summarize_mc.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    by_policy = {cells[3].strip(): cells for cells in rows}
    assert set(by_policy) == {"attention_gate", "h2o"}
    h2o = by_policy["h2o"]
    assert h2o[6].strip() == "2" and h2o[7].strip() == "8"  # two tasks, eight examples, once
    # task means: rte +25, copa +50 -> +37.5 over the pooled examples
    assert h2o[-2].strip().startswith("+37.50") and h2o[-2].strip().endswith("(n=8)")


def test_same_budget_pairs_each_row_with_the_reference_at_its_budget(tmp_path, monkeypatch, capsys):
    def at(rec: dict, budget: str) -> dict:
        return rec | {"budget": budget}

    recs = {"r5": at(record("ranked", "masked", [1, 1, 1, 1]), "0.5"),
            "r3": at(record("ranked", "masked", [1, 1, 0, 0]), "0.3"),
            "h5": at(record("h2o", "masked", [1, 0, 0, 0]), "0.5"),
            "h3": at(record("h2o", "masked", [1, 0, 0, 0]), "0.3"),
            "h1": at(record("h2o", "cache", [0, 0, 0, 0]), "0.1")}
    (tmp_path / "results.json").write_text(json.dumps({"meta": {}, "results": recs}))
    monkeypatch.setattr(sys, "argv", ["summarize_mc.py", str(tmp_path), "--paired", "ranked",
                                      "--same-budget", "--any-mode"])
    summarize_mc.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    gaps = {(c[3].strip(), c[4].strip()): c[-2].strip() for c in rows}
    assert gaps["h2o", "0.5"].startswith("+75.00")
    assert gaps["h2o", "0.3"].startswith("+25.00")
    assert gaps["h2o", "0.1"] == ""  # no reference at that budget in any mode


def test_folder_list_pairs_with_a_gate_split_over_folders(tmp_path, monkeypatch, capsys):
    """a,b:attention_gate pools the gate of a run split by task (rte in a, copa in b) and
    pairs another gate that ran both tasks in one folder with it, over both tasks."""
    for name, task, hits in (("a", "rte", [1, 1, 1, 1]), ("b", "copa", [1, 1, 1, 1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"meta": {}, "results": {"g": record("attention_gate", "masked", hits, task)}}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.json").write_text(json.dumps({"meta": {}, "results": {
        "r": record("attention_gate", "masked", [1, 1, 0, 0], "rte"),
        "c": record("attention_gate", "masked", [0, 0, 0, 0], "copa")}}))
    monkeypatch.setattr(sys, "argv", ["summarize_mc.py", *(str(tmp_path / n) for n in "abc"),
                                      "--paired", "a,b:attention_gate"])
    summarize_mc.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    gaps = {cells[1].strip(): cells[-2].strip() for cells in rows}
    assert gaps["a"] == "" and gaps["b"] == ""
    assert gaps["c"].startswith("+75.00") and gaps["c"].endswith("(n=8)")  # (50 + 100) / 2


def test_metric_acc_norm_pairs_on_the_per_character_winner(tmp_path, monkeypatch, capsys):
    # two examples, gold 0: by sum the gate wins both and the full cache neither; per
    # character (choice 1 is 4x longer) the order flips on the first example only
    def rec(policy, lls):
        examples = {f"rte:{i}": {"task": "rte", "gold": 0, "ll": ll, "chars": [1, 4]}
                    for i, ll in enumerate(lls)}
        return {"kind": "mc", "task": "rte", "policy": policy, "budget": "none",
                "mode": "masked", "n": 2, "acc": 0.0, "acc_norm": 0.0, "evict_pct": 0.0,
                "complete": True, "examples": examples}
    recs = {"g": rec("attention_gate", [[-3.0, -3.5], [-1.0, -8.0]]),
            "f": rec("full", [[-3.0, -2.0], [-9.0, -8.0]])}
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"meta": {}, "results": recs}))
    gaps = {}
    for metric in ("acc", "acc_norm"):
        monkeypatch.setattr(sys, "argv", ["summarize_mc.py", str(out), "--paired",
                                          "attention_gate", "--metric", metric])
        summarize_mc.main()
        lines = capsys.readouterr().out.splitlines()
        assert f"{metric} gap vs paired" in lines[0]
        gaps[metric] = next(line for line in lines if "| full |" in line).split("|")[-2]
    # acc: gate 2/2, full 0/2. acc_norm: gate -3 vs -0.875 (miss), -1 vs -2 (hit);
    # full -3 vs -0.5 (miss), -9 vs -2 (miss): gate 1/2, full 0/2
    assert gaps["acc"].strip().startswith("+100.00")
    assert gaps["acc_norm"].strip().startswith("+50.00")
