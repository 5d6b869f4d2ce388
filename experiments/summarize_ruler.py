"""The RULER tables of docs/RESULTS.md section 3 from one or more `kvgate eval ruler` folders.

    python experiments/summarize_ruler.py experiments/results/ruler/heuristics \
        cpt_long=experiments/results/ruler/cpt_long cpt_recipe=experiments/results/ruler/cpt_recipe \
        --tasks niah_single_1,niah_single_2,niah_multikey_1,qa_1 --lengths 1024,2048,4096

A folder given as NAME=DIR prefixes its gate rows with NAME (two gates both run as
`attention_gate`). Prints: one row per policy with a column per length and eviction level (25 /
50 / 75 %: the budgets 0.75 / 0.5 / 0.25 kept; a gate at its own keep threshold goes to the
level nearest its eviction, which the cell gives); the average over the task families per (policy, budget, mode) and
length, with its 95% interval (``kvgate.eval.intervals.share_interval``), %Evict and the seconds per
example (not side by side: the runs shared the machine with different jobs; the ratios to the
full cache are bench/bench_long_context.py's); the per-family scores at one budget; and the issue-#34 targets:
per length, on the families where the full cache scores >= 30%, each gate minus the best
heuristic of each family at that budget, with a paired 95% interval of the mean gap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.eval.intervals import paired_share_interval, share_interval

GATES = ("attention_gate", "gate_hybrid")


def load(specs: list[str], tasks: list[str], lengths: list[int]) -> list[dict]:
    rows = []
    for spec in specs:
        name, _, folder = spec.rpartition("=")
        data = json.loads((Path(folder) / "results.json").read_text())["results"]
        for r in data.values():
            if r.get("kind") != "ruler" or r["family"] not in tasks or r["length"] not in lengths:
                continue
            label = r["policy"]
            if name and (r["spec"]["policy"] in GATES):
                label = f"{name}:{label}"
            ex = {uid.split(":")[1]: e for uid, e in r["examples"].items()}
            rows.append({**r, "label": label, "ex": ex})
    return rows


def fmt(x: float, d: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


LEVELS = (25, 50, 75)  # % evicted: the heuristics' budgets 0.75 / 0.5 / 0.25 kept


def _level(label: str, budget: str, evict: float) -> int | None:
    """The eviction column of a setting: a budget's, or for a gate run at its own threshold the
    level nearest to what it evicted; None for the full cache (one value per length)."""
    if label == "full":
        return None
    if budget != "none":
        return round(100 * (1 - float(budget)))
    return min(LEVELS, key=lambda v: abs(v - evict))


def _row_name(label: str, budget: str, mode: str) -> str:
    base = label.rsplit(":", 1)
    if len(base) == 2 and budget == "none":  # NAME:attention_gate or NAME:gate_tauXX
        return f"{base[0]} gate (threshold)"
    if len(base) == 2:
        return f"{base[0]} gate ranked" if base[1] == "gate_rank" else f"{base[0]} {base[1]}"
    return label if mode == "agnostic" else f"{label} ({mode})"


def wide_table(cell: dict, settings: list, tasks: list[str], lengths: list[int]) -> None:
    """One row per policy, a column per (length, eviction level): the family average with its
    95% interval; a gate at its own threshold also gives the eviction it reached."""
    table: dict[str, dict[tuple[int, int | None], str]] = {}
    for label, budget, mode in settings:
        for n in lengths:
            got = [cell.get((label, budget, mode, n, f)) for f in tasks]
            if any(g is None for g in got):
                continue
            ev = sum(g["evict_pct"] for g in got) / len(got)
            lo, hi = share_interval([[float(e["score"]) for e in g["ex"].values()]
                                     for g in got])
            acc = sum(g["acc"] for g in got) / len(got)
            text = f"{fmt(acc, 0)} [{fmt(lo, 0)}, {fmt(hi, 0)}]"
            if budget == "none" and label != "full":
                text += f" @{fmt(ev, 0)}%"
            table.setdefault(_row_name(label, budget, mode), {})[(n, _level(label, budget, ev))] = text
    cols = [(n, v) for n in lengths for v in LEVELS]
    print("| policy | " + " | ".join(f"{n} @{v}%" for n, v in cols) + " |")
    print("|" + "---|" * (1 + len(cols)))
    for name, row in table.items():
        if name == "full":  # nothing evicted: its score once per length, in the middle
            print("| full | " + " | ".join(row.get((n, None), "-") if v == 50 else ""
                                          for n, v in cols) + " |")
            continue
        print(f"| {name} | " + " | ".join(row.get(c, "-") for c in cols) + " |")
    print()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="DIR or NAME=DIR")
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--budget", default="0.5", help="budget of the per-family table / targets")
    args = ap.parse_args(argv)
    tasks = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = load(args.folders, tasks, lengths)
    cell = {(r["label"], r["budget"], r["mode"], r["length"], r["family"]): r for r in rows}
    settings = sorted({(r["label"], r["budget"], r["mode"]) for r in rows},
                      key=lambda s: (s[0] != "full", s[2], s[0], s[1]))

    def scores(label, budget, mode, length, family):
        r = cell.get((label, budget, mode, length, family))
        return None if r is None else {k: float(e["score"]) for k, e in r["ex"].items()}

    print(f"families: {', '.join(tasks)}\n")
    wide_table(cell, settings, tasks, lengths)
    head = "| policy | budget | mode | " + " | ".join(
        f"{n} score [95% CI] | %Evict | s/ex" for n in lengths) + " |"
    print(head)
    print("|" + "---|" * (3 + 3 * len(lengths)))
    for label, budget, mode in settings:
        cols = []
        for n in lengths:
            got = [cell.get((label, budget, mode, n, f)) for f in tasks]
            if any(g is None for g in got):
                cols += ["-", "-", "-"]
                continue
            groups = [[float(e["score"]) for e in g["ex"].values()] for g in got]
            lo, hi = share_interval(groups)
            acc = sum(g["acc"] for g in got) / len(got)
            ev = sum(g["evict_pct"] for g in got) / len(got)
            secs = sum(g["sec_per_example"] for g in got) / len(got)
            cols += [f"{fmt(acc)} [{fmt(lo)}, {fmt(hi)}]", fmt(ev), fmt(secs)]
        print(f"| {label} | {budget} | {mode} | " + " | ".join(cols) + " |")

    print(f"\nper family (score %), budget {args.budget} and the gates' own rows, question after "
          "compression:\n")
    print("| policy | budget | " + " | ".join(f"{f}@{n}" for n in lengths for f in tasks) + " |")
    print("|" + "---|" * (2 + len(lengths) * len(tasks)))
    for label, budget, mode in settings:
        if mode != "agnostic" or budget not in (args.budget, "none"):
            continue
        vals = [cell.get((label, budget, mode, n, f)) for n in lengths for f in tasks]
        print(f"| {label} | {budget} | " + " | ".join(
            "-" if v is None else fmt(v["acc"], 0) for v in vals) + " |")

    heur = sorted({s[0] for s in settings if ":" not in s[0] and s[0] != "full"
                   and s[0] not in GATES and s[2] == "agnostic"})
    # the gates at ~the target's eviction: ranked at the budget, or at their trained threshold
    # (not the rows run at other thresholds, gate_tauXX)
    gates = sorted({(s[0], s[1]) for s in settings if (":" in s[0] or s[0] in GATES)
                    and s[2] == "agnostic" and (s[1] == args.budget
                                                or s[0].endswith("attention_gate"))})
    print(f"\ntargets (budget {args.budget}, families where full >= 30%): gate minus the best "
          "heuristic of each family, mean over families [paired 95% CI]\n")
    print("| gate | length | families | gate | best heuristics | gap [95% CI] | families at or above |")
    print("|---|---|---|---|---|---|---|")
    for label, budget in gates:
        for n in lengths:
            fams = [f for f in tasks if (s := scores("full", "none", "agnostic", n, f))
                    and sum(s.values()) / len(s) >= 30.0]
            diffs, at_or_above, best_names, gate_acc = [], 0, [], []
            for f in fams:
                g = scores(label, budget, "agnostic", n, f)
                cand = [(h, scores(h, args.budget, "agnostic", n, f)) for h in heur]
                cand = [(h, s) for h, s in cand if s]
                if not g or not cand:
                    continue
                h, s = max(cand, key=lambda hs: sum(hs[1].values()) / len(hs[1]))
                common = sorted(set(g) & set(s))
                diffs.append([(g[k], s[k]) for k in common])
                m_g = sum(g[k] for k in common) / len(common)
                m_h = sum(s[k] for k in common) / len(common)
                at_or_above += m_g >= m_h
                best_names.append(f"{f}: {h} {fmt(m_h, 0)}")
                gate_acc.append(m_g)
            if not diffs:
                continue
            gap = sum(sum(a - b for a, b in d) / len(d) for d in diffs) / len(diffs)
            lo, hi = paired_share_interval(diffs)
            print(f"| {label} | {n} | {len(diffs)} | {fmt(sum(gate_acc) / len(gate_acc))} | "
                  f"{'; '.join(best_names)} | {fmt(gap)} [{fmt(lo)}, {fmt(hi)}] | "
                  f"{at_or_above}/{len(diffs)} |")


if __name__ == "__main__":
    main()
