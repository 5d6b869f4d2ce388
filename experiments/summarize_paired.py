"""The powered RULER table of docs/RESULTS.md section 3: every row's score with its sample size,
and paired differences to the full cache and to the best single heuristic.

    python experiments/summarize_paired.py experiments/results/ruler/powered \
        cpt_recipe=experiments/results/ruler/powered_cpt_recipe \
        cpt_long=experiments/results/ruler/powered_cpt_long \
        --tasks niah_single_1,niah_single_2,niah_multikey_1 --lengths 1024,2048,4096 \
        --budget 0.5 [--families-from full]

Rows: every (folder, policy, budget) at ``--budget`` (and budget-free rows such as a gate at its
trained threshold), a folder given as NAME=DIR prefixing its policies with NAME. Per length:
the mean over families (each family's mean, then their average) with a 95% interval
(``kvgate.eval.intervals.share_interval``: Wilson's at an effective size, never of zero width at
0 or 100%), n = examples, and the paired difference on the examples both rows hold (its
interval ``kvgate.eval.paired``'s: MOVER, Newcombe's method 10 for one family) to
the full cache and to the best single heuristic: the heuristic row with the highest average
at that length (``--heuristics`` lists which rows count). Families: those where the full
cache scores >= 30% at every length (``--min-full``). A second table gives each family
separately at each length: every row's score and its paired gap to the family's best
heuristic.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.eval.intervals import share_interval
from kvgate.eval.paired import paired_difference

HEURISTICS = ("streaming", "h2o", "tova", "snapkv", "knorm", "adakv", "tova_g", "snapkv_g",
              "h2o_g", "pyramidkv", "nacl", "ahakv", "roco", "window", "random")


def load(specs, budget):
    """{(row, family, length): record} from the folders' results.json."""
    cells = {}
    for spec in specs:
        name, _, folder = spec.rpartition("=")
        path = Path(folder) / "results.json"
        if not path.exists():  # a length not run yet: its cells stay empty
            print(f"(no {path}: skipped)", file=sys.stderr)
            continue
        data = json.loads(path.read_text())["results"]
        for key, r in data.items():
            _, task, policy, bud, mode = key.split("|")
            if bud not in (str(budget), "none") or mode != "agnostic":
                continue
            family, length = task.split("@")
            row = f"{name}:{policy}" if name else policy
            cells[(row, family, int(length))] = r
    return cells


def fmt(x, d=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def average(cells, row, families, length):
    groups = [[float(e["score"]) for e in cells[(row, f, length)]["examples"].values()]
              for f in families if (row, f, length) in cells]
    if len(groups) < len(families):
        return None
    lo, hi = share_interval(groups)
    return {"mean": sum(sum(g) / len(g) for g in groups) / len(groups), "lo": lo, "hi": hi,
            "n": sum(map(len, groups)),
            "evict": sum(cells[(row, f, length)].get("evict_pct", 0.0) for f in families)
            / len(families)}


def paired(cells, row, ref, families, length):
    if row == ref or any((r, f, length) not in cells for r in (row, ref) for f in families):
        return None
    return paired_difference([cells[(row, f, length)] for f in families],
                             [cells[(ref, f, length)] for f in families])


def gap(p):
    if p is None or not p["n"]:
        return "-"
    return f"{p['diff']:+.1f} [{p['ci_low']:+.1f}, {p['ci_high']:+.1f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--min-full", type=float, default=30.0)
    ap.add_argument("--heuristics", default=",".join(HEURISTICS))
    args = ap.parse_args(argv)
    tasks = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    heur = set(args.heuristics.split(","))
    cells = load(args.folders, args.budget)
    rows = sorted({r for r, _, _ in cells}, key=lambda r: (r != "full", r in heur, r))
    families = [f for f in tasks
                if all((("full", f, n) in cells) and cells[("full", f, n)]["acc"] >= args.min_full
                       for n in lengths)]
    print(f"families (full >= {args.min_full:g}% at every length): {', '.join(families)}; "
          f"budget {args.budget}\n")
    best = {}
    for n in lengths:
        avgs = {r: average(cells, r, families, n) for r in rows if r in heur}
        avgs = {r: a for r, a in avgs.items() if a}
        best[n] = max(avgs, key=lambda r: avgs[r]["mean"]) if avgs else None
    print("| policy | " + " | ".join(
        f"{n} score [95% CI] (n) | {n} %Evict | {n} vs full | {n} vs best heuristic"
        for n in lengths) + " |")
    print("|---|" + "---|---|---|---|" * len(lengths))
    for r in rows:
        parts = []
        for n in lengths:
            a = average(cells, r, families, n)
            if a is None:
                parts += ["-"] * 4
                continue
            parts += [f"{a['mean']:.1f} [{a['lo']:.1f}, {a['hi']:.1f}] ({a['n']})",
                      fmt(a["evict"], 0), gap(paired(cells, r, "full", families, n)),
                      gap(paired(cells, r, best[n], families, n))]
        print(f"| {r} | " + " | ".join(parts) + " |")
    print("\nbest single heuristic per length: "
          + ", ".join(f"{n}: {best[n]}" for n in lengths))
    print("\nPer family: score (n), paired gap to the family's best heuristic at that length\n")
    print("| policy | " + " | ".join(f"{f}@{n}" for n in lengths for f in families) + " |")
    print("|---|" + "---|" * (len(lengths) * len(families)))
    fam_best = {}
    for n in lengths:
        for f in families:
            cand = {r: cells[(r, f, n)]["acc"] for r in rows if r in heur and (r, f, n) in cells}
            fam_best[(f, n)] = max(cand, key=cand.get) if cand else None
    for r in rows:
        parts = []
        for n in lengths:
            for f in families:
                if (r, f, n) not in cells:
                    parts.append("-")
                    continue
                c = cells[(r, f, n)]
                b = fam_best[(f, n)]
                g = paired(cells, r, b, [f], n) if b else None
                parts.append(f"{c['acc']:.0f} ({c['n']})" + ("" if g is None else f" {gap(g)}"))
        print(f"| {r} | " + " | ".join(parts) + " |")
    print("\nfamily's best heuristic: " + ", ".join(
        f"{f}@{n}: {fam_best[(f, n)]}" for n in lengths for f in families))


if __name__ == "__main__":
    main()
