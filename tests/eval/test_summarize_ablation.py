"""experiments/summarize_ablation.py: the heuristic nearest the gate's eviction, the paired gap over
the gate's windows, and a recipe's seeds pooled into one row (over seeds and over windows)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from conftest import load_script

from kvgate.eval.benchmarks.ppl.report import plot_ppl_vs_eviction

summarize_ablation = load_script("experiments/summarize_ablation.py")

TOKENS = 100


def record(policy: str, evict: float, nll: list[float]) -> dict:
    """A perplexity record over windows w0, w1, ... with the given per-token NLLs."""
    examples = {f"w{i}": {"ll": [-x * TOKENS], "tokens": [TOKENS]} for i, x in enumerate(nll)}
    return {"task": "corpus@8+8", "policy": policy, "evict_pct": evict, "complete": True,
            "n": len(nll), "tokens": TOKENS * len(nll),
            "ppl": math.exp(sum(nll) / len(nll)), "examples": examples}


def write(folder: Path, name: str, *recs: dict) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "results.json").write_text(json.dumps(
        {"meta": {}, "results": {f"k{i}": r for i, r in enumerate(recs)}}))


def test_gap_to_the_nearest_budget_and_seeds_pooled(tmp_path):
    h2o = [2.0, 2.1, 1.9, 2.0]
    write(tmp_path, "heuristics", record("full", 0, [1.8] * 4),
          record("h2o", 50.0, h2o), record("h2o", 30.0, [0.0] * 4),  # far budget: ignored
          record("snapkv", 50.0, [x + 0.1 for x in h2o]))
    write(tmp_path, "gate_run", record("attention_gate", 51.0, [x - 0.02 for x in h2o]))
    write(tmp_path, "gate_run_seed1", record("attention_gate", 49.0, [x - 0.04 for x in h2o]))
    write(tmp_path, "gate_run_seed2", record("attention_gate", 50.5,
                                               [x + d for x, d in zip(h2o, [.1, -.1, .1, -.1])]))
    write(tmp_path, "gate_other", record("attention_gate", 50.0, h2o))  # one seed: not pooled
    lines = summarize_ablation.table(tmp_path)
    cut = lines.index("the same recipe over seeds (gate - best heuristic, log-PPL)")
    rows = {line.split("|")[1].strip(): line.split("|")
            for line in lines[:cut] if line.startswith("| ")}
    seeds = [line.split("|") for line in lines[cut + 4:] if line.startswith("| ")]
    # per gate: h2o at the nearer budget is the best heuristic, the gap is over the same windows
    assert rows["run"][-2].strip() == "-0.0200 [-0.0200, -0.0200] (n=4)"
    assert rows["run_seed1"][4].strip().startswith(f"{math.exp(2.0):.3f} @ 50.0")
    assert rows["run_seed2"][-2].strip().startswith("+0.0000 [-0.1132, +0.1132]")
    # pooled: three seeds, mean of (-0.02, -0.04, 0.00), t interval with 2 degrees of freedom
    assert len(seeds) == 1 and seeds[0][1].strip() == "run" and seeds[0][2].strip() == "3"
    sd = math.sqrt(((-0.02 + 0.02) ** 2 + (-0.04 + 0.02) ** 2 + (0.0 + 0.02) ** 2) / 2)
    half = 4.303 * sd / math.sqrt(3)
    assert seeds[0][4].strip() == f"{-0.02:+.4f} [{-0.02 - half:+.4f}, {-0.02 + half:+.4f}]"
    # holding the three gates fixed: their average gap per window, interval over windows
    avg = [(-0.02 - 0.04 + d) / 3 for d in (.1, -.1, .1, -.1)]
    sd_w = math.sqrt(sum((a + 0.02) ** 2 for a in avg) / 3)
    half_w = 1.96 * sd_w / 2
    assert seeds[0][5].strip() == f"{-0.02:+.4f} [{-0.02 - half_w:+.4f}, {-0.02 + half_w:+.4f}] (n=4)"
    assert seeds[0][6].strip() == "2 below, 0 above"
    assert seeds[0][3].strip().startswith("run (51.0% evicted): -0.0200")  # seed 0 first
    assert "other" in rows  # a recipe with one seed is in the main table only


def test_curves_share_the_gates_windows_and_join_a_gates_thresholds(tmp_path):
    h2o = [2.0, 2.2, 1.8, 2.0, 5.0]  # the fifth window: scored by the heuristic only
    write(tmp_path, "heuristics", record("full", 0, [1.8] * 5), record("h2o", 50.0, h2o),
          record("h2o", 40.0, [x - 0.1 for x in h2o]), record("random", 50.0, [9.0] * 5),
          record("snapkv", 50.0, h2o[:3]))  # lacks a gate window: left out, named
    write(tmp_path, "gate_run", record("attention_gate", 42.0, [1.9] * 4))
    write(tmp_path, "gate_run_tau56", record("gate_tau56", 50.0, [1.95] * 4))
    write(tmp_path, "gate_other", record("attention_gate", 50.0, [3.0] * 4))
    points, skipped = summarize_ablation.curve_records(tmp_path, re.compile(r"^run"))
    by = {(p["policy"], p["evict_pct"]): p["ppl"] for p in points}
    assert set(by) == {("gate run", 42.0), ("gate run", 50.0), ("full", 0),
                       ("h2o", 50.0), ("h2o", 40.0)}  # no random, no other gate, no snapkv
    assert skipped == ["snapkv @ 50.0%"]
    assert by[("h2o", 50.0)] == pytest.approx(math.exp(2.0))  # over the gates' four windows
    assert by[("gate run", 50.0)] == pytest.approx(math.exp(1.95))
    path = plot_ppl_vs_eviction(points, tmp_path / "curve.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_no_curve_without_a_shared_window(tmp_path):
    write(tmp_path, "heuristics", record("h2o", 50.0, [2.0] * 4))
    write(tmp_path, "gate_run", record("attention_gate", 42.0, [1.9] * 4))
    assert summarize_ablation.curve_records(tmp_path, re.compile("nomatch")) == ([], [])
    other = record("attention_gate", 40.0, [1.9] * 2)
    other["examples"] = {"x0": other["examples"]["w0"]}  # scored other text than gate_run
    write(tmp_path, "gate_run_seed1", other)
    assert summarize_ablation.curve_records(tmp_path, re.compile("^run")) == ([], [])
    assert plot_ppl_vs_eviction([], tmp_path / "none.png") is None


def test_seeds_pool_without_seed_zero(tmp_path):
    h2o = [2.0, 2.1, 1.9, 2.0]
    write(tmp_path, "heuristics", record("h2o", 50.0, h2o))
    write(tmp_path, "gate_run_seed1_tau60", record("g", 50.0, [x - 0.02 for x in h2o]))
    write(tmp_path, "gate_run_seed2_tau60", record("g", 50.0, [x - 0.04 for x in h2o]))
    lines = summarize_ablation.table(tmp_path)
    seeds = [line.split("|") for line in lines if line.startswith("| run_tau60 ")]
    assert len(seeds) == 1 and seeds[0][2].strip() == "2"
    assert seeds[0][4].strip().startswith(f"{-0.03:+.4f}")


def test_a_heuristic_far_from_the_gates_eviction_is_shown_not_taken_as_best(tmp_path):
    h2o = [2.0, 2.1, 1.9, 2.0]
    # SnapKV scored only at 70%: its lower perplexity there must not count against a gate at 80%
    write(tmp_path, "heuristics", record("h2o", 80.5, h2o),
          record("snapkv", 70.0, [x - 0.3 for x in h2o]))
    write(tmp_path, "gate_run", record("attention_gate", 80.0, [x - 0.01 for x in h2o]))
    row = next(line.split("|") for line in summarize_ablation.table(tmp_path)
               if line.startswith("| run "))
    assert row[5].strip() == f"{math.exp(1.7):.3f} @ 70.0 (10.0 points off)"
    assert row[-2].strip() == "-0.0100 [-0.0100, -0.0100] (n=4)"  # paired with h2o
    # a wider tolerance lets SnapKV back in, and it is then the best
    row = next(line.split("|") for line in summarize_ablation.table(tmp_path, max_gap=12.0)
               if line.startswith("| run "))
    assert row[-2].strip() == "+0.2900 [+0.2900, +0.2900] (n=4)"
    # nothing near the gate: no best heuristic, no gap
    write(tmp_path, "gate_far", record("attention_gate", 40.0, h2o))
    row = next(line.split("|") for line in summarize_ablation.table(tmp_path)
               if line.startswith("| far "))
    assert row[-3].strip() == "-" and row[-2].strip() == "-"


def test_other_heuristics_in_the_folder_get_columns_and_can_be_best(tmp_path):
    h2o = [2.0, 2.1, 1.9, 2.0]
    write(tmp_path, "heuristics", record("full", 0, [1.8] * 4), record("h2o", 50.0, h2o),
          record("pyramidkv", 50.0, [x + 0.1 for x in h2o]),
          record("ada_h2o", 50.0, [x - 0.05 for x in h2o]))
    write(tmp_path, "gate_run", record("attention_gate", 50.0, [x - 0.02 for x in h2o]))
    lines = summarize_ablation.table(tmp_path)
    head = next(line for line in lines if line.startswith("| gate (run)")).split("|")
    assert [h.strip().removesuffix(" PPL @ %Evict") for h in head[4:-3]] == [
        "h2o", "snapkv", "streaming", "random", "ada_h2o", "pyramidkv"]
    row = next(line.split("|") for line in lines if line.startswith("| run "))
    assert len(row) == len(head) and row[5].strip() == "-"  # no snapkv in this folder
    assert row[-2].strip() == "+0.0300 [+0.0300, +0.0300] (n=4)"  # against ada_h2o, the best
