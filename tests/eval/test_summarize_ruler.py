"""experiments/summarize_ruler.py: family averages, the per-family table and the target gap
(gate minus each family's best heuristic, on the families where the full cache scores >= 30%)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

summarize_ruler = load_script("experiments/summarize_ruler.py")


def record(policy: str, budget: str, family: str, scores: list[float]) -> dict:
    examples = {f"{family}@1024:{i}": {"score": s} for i, s in enumerate(scores)}
    return {"kind": "ruler", "task": f"{family}@1024", "family": family, "length": 1024,
            "policy": policy, "budget": budget, "mode": "agnostic",
            "spec": {"policy": "attention_gate" if policy == "attention_gate" else policy},
            "n": len(scores), "acc": sum(scores) / len(scores), "evict_pct": 50.0,
            "sec_per_example": 1.0, "examples": examples}


def write(folder: Path, recs: list[dict]) -> str:
    folder.mkdir()
    results = {f"{r['policy']}|{r['family']}|{r['budget']}": r for r in recs}
    (folder / "results.json").write_text(json.dumps({"meta": {}, "results": results}))
    return str(folder)


def test_gap_to_the_best_heuristic_per_family(tmp_path, capsys):
    heur = write(tmp_path / "h", [
        record("full", "none", "a", [100, 100, 0]), record("full", "none", "b", [100, 0, 0]),
        record("full", "none", "c", [0, 0, 0]),  # below 30%: left out of the target
        record("snapkv", "0.5", "a", [100, 0, 0]), record("snapkv", "0.5", "b", [0, 0, 0]),
        record("snapkv", "0.5", "c", [100, 100, 100]),
        record("tova", "0.5", "a", [0, 0, 0]), record("tova", "0.5", "b", [100, 0, 0]),
        record("tova", "0.5", "c", [0, 0, 0]),
    ])
    gate = write(tmp_path / "g", [
        record("attention_gate", "none", "a", [100, 100, 0]),
        record("attention_gate", "none", "b", [100, 0, 0]),
        record("attention_gate", "none", "c", [0, 0, 0]),
    ])
    summarize_ruler.main([heur, f"long={gate}", "--tasks", "a,b,c", "--lengths", "1024"])
    out = capsys.readouterr().out
    # family averages: snapkv (33.3 + 0 + 100) / 3
    assert "| snapkv | 0.5 | agnostic | 44.4 [" in out
    # target: families a and b only; best heuristic a: snapkv 33, b: tova 33; gate 67 and 33
    row = next(line for line in out.splitlines() if line.startswith("| long:attention_gate | 1024"))
    assert "| 2 | 50.0 |" in row and "a: snapkv 33" in row and "b: tova 33" in row
    assert "| 16.7 [" in row and row.endswith("| 2/2 |")


def test_wide_table_one_row_per_policy_by_eviction_level(tmp_path, capsys):
    """Budgets 0.75 / 0.5 / 0.25 fill the 25 / 50 / 75 % columns; a gate at a keep threshold
    lands in the column nearest its eviction and says what it reached; the full cache once."""
    heur = write(tmp_path / "h", [record("full", "none", "a", [100, 100, 0])] + [
        record("snapkv", b, "a", s) for b, s in (("0.75", [100, 100, 100]), ("0.5", [100, 0, 0]),
                                                 ("0.25", [0, 0, 0]))])
    tau = record("gate_tau68", "none", "a", [100, 0, 0])
    tau["spec"]["policy"], tau["evict_pct"] = "attention_gate", 71.0
    gate = write(tmp_path / "g", [record("attention_gate", "none", "a", [100, 100, 0]), tau])
    summarize_ruler.main([heur, f"long={gate}", "--tasks", "a", "--lengths", "1024"])
    out = capsys.readouterr().out
    assert "| policy | 1024 @25% | 1024 @50% | 1024 @75% |" in out
    assert "| full |  | 67 [" in out
    # 3 of 3 and 0 of 3 are not certain: Wilson's [44, 100] and [0, 56] (#64 case 9)
    assert "| snapkv | 100 [44, 100] | 33 [" in out and "| 0 [0, 56] |" in out
    row = next(line for line in out.splitlines() if line.startswith("| long gate (threshold)"))
    cells = row.split(" | ")[1:]
    assert cells[0] == "-" and cells[1].startswith("67 [") and cells[1].endswith("@50%")
    assert cells[2].startswith("33 [") and cells[2].endswith("@71% |")
