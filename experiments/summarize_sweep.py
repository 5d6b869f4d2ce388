"""Accuracy against eviction at one length (docs/RESULTS.md section 3's sweep): every row at
each budget, with its paired gap to the best single heuristic at that budget.

    python experiments/summarize_sweep.py experiments/results/ruler/powered \
        kvzip=experiments/results/ruler/powered_kvzip \
        cpt_kvzap=experiments/results/ruler/powered_cpt_kvzap --length 2048 \
        --budgets 0.75,0.5,0.25 --place cpt_kvzap:e25=0.75 --place cpt_kvzap:local_gate=0.5 \
        --place cpt_kvzap:e75=0.25

Folders as in ``summarize_paired.py`` (NAME=DIR prefixes its policies with NAME). A budget-free
row (a gate at a dialled threshold) has no budget of its own: ``--place ROW=BUDGET`` puts it in
that budget's column (its %Evict is printed beside it); other budget-free rows but ``full``
are left out. Scores are the mean over families with a 95% interval (``share_interval``, as
in ``summarize_paired.py``) and n; gaps are paired on the examples both rows hold (``kvgate.eval.paired``), to
the best heuristic at that budget and, with ``--ref ROW``, to that row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize_paired import HEURISTICS, average, gap, load, paired


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budgets", default="0.75,0.5,0.25")
    ap.add_argument("--place", action="append", default=[], metavar="ROW=BUDGET")
    ap.add_argument("--heuristics", default=",".join(HEURISTICS))
    ap.add_argument("--ref", default=None, help="a row: each row's paired gap to it too")
    args = ap.parse_args(argv)
    families, n = args.tasks.split(","), args.length
    heur = set(args.heuristics.split(","))
    place = {}
    for item in args.place:
        row, _, budget = item.rpartition("=")
        place[row] = float(budget)
    budgets = [float(b) for b in args.budgets.split(",")]
    # per budget: {row: {family: record}}, a placed budget-free row under its budget only
    cols, rows = {}, []
    for b in budgets:
        cells = load(args.folders, b)
        keep = {}
        for (row, fam, length), rec in cells.items():
            if length != n:
                continue
            free = rec.get("budget") == "none"
            if free and row != "full" and place.get(row) != b:
                continue
            keep[(row, fam, n)] = rec
            if row not in rows:
                rows.append(row)
        cols[b] = keep
    rows.sort(key=lambda r: (r != "full", r in heur, r))
    best = {}
    for b, cells in cols.items():
        avgs = {r: average(cells, r, families, n) for r in rows if r in heur}
        avgs = {r: a for r, a in avgs.items() if a}
        best[b] = max(avgs, key=lambda r: avgs[r]["mean"]) if avgs else None
    print(f"length {n}, families {', '.join(families)}\n")
    ref = f" | vs {args.ref}" if args.ref else ""
    print("| policy | " + " | ".join(f"{round(100 * (1 - b), 1):g}% evicted: score [95% CI] (n), %Evict "
                                      f"| vs best heuristic{ref}" for b in budgets) + " |")
    print("|---|" + ("---|---|---|" if ref else "---|---|") * len(budgets))
    for r in rows:
        parts = []
        for b in budgets:
            a = average(cols[b], r, families, n)
            if a is None:
                parts += ["", "", ""] if ref else ["", ""]
                continue
            score = f"{a['mean']:.1f} [{a['lo']:.1f}, {a['hi']:.1f}] ({a['n']}), {a['evict']:.0f}"
            parts += [score, gap(paired(cols[b], r, best[b], families, n)) if best[b] else "-"]
            if ref:
                parts.append(gap(paired(cols[b], r, args.ref, families, n)))
        if any(parts):
            print(f"| {r} | " + " | ".join(parts) + " |")
    print("\nbest single heuristic: " + ", ".join(
        f"{100 * (1 - b):.0f}%: {best[b]}" for b in budgets))


if __name__ == "__main__":
    main()
