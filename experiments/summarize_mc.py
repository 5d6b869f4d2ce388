"""Average accuracy and %Evict per policy over tasks from one or more results.json files.

    python experiments/summarize_mc.py experiments/results/mc_base_050 [more folders ...]
    python experiments/summarize_mc.py experiments/results/mc_tasks --paired attention_gate

Prints a markdown table: policy, budget, tasks, examples, mean acc, mean acc_norm, mean %Evict
(task-level means, each task weighted equally, as the papers' averages are).
``--paired NAME`` adds, per policy, the accuracy gap NAME - policy over the examples both
scored (same mode), with a 95% interval of that task-weighted mean difference;
``--paired FOLDER:NAME`` takes NAME's records from that results folder alone, so two gates
given in two folders are paired with each other (``FOLDER,FOLDER:NAME``: a gate whose run was
split over folders by task). ``--same-budget`` pairs each row with NAME's
record at the same budget (NAME run at several fixed budgets, e.g. a ranked gate). ``--merge``
pools the folders of one run that was split over folders by task. ``--any-mode``
pairs across modes where NAME ran in one mode only (the full cache scores the same in masked
and cache mode). A record stored without its per-example records (experiments/results keeps
them only where a table of docs/RESULTS.md pairs them) gets its means and no paired gap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.eval.multiple_choice import is_correct


def paired_gap(ref: list[dict], other: list[dict],
               metric: str = "acc") -> tuple[float, float, int]:
    """Task-weighted mean of metric(ref) - metric(other) over shared examples, its 95%
    half-width (normal approximation, tasks independent) and the number of shared examples."""
    by_task = {r["task"]: r.get("examples", {}) for r in other}
    means, variances, shared = [], [], 0
    for r in ref:
        theirs = by_task.get(r["task"], {})
        diffs = [float(is_correct(ex, metric)) - float(is_correct(theirs[uid], metric))
                 for uid, ex in r.get("examples", {}).items()
                 if uid in theirs]
        if not diffs:
            continue
        m = sum(diffs) / len(diffs)
        var = sum((d - m) ** 2 for d in diffs) / max(1, len(diffs) - 1)
        means.append(m)
        variances.append(var / len(diffs))
        shared += len(diffs)
    if not means:
        return math.nan, math.nan, 0
    k = len(means)
    return 100 * sum(means) / k, 100 * 1.96 * math.sqrt(sum(variances)) / k, shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--paired", default=None,
                    help="policy to pair every other policy with (FOLDER:POLICY: that folder's)")
    ap.add_argument("--any-mode", action="store_true",
                    help="pair with NAME's records of another mode where its mode has none")
    ap.add_argument("--same-budget", action="store_true",
                    help="pair with NAME's record at the row's own budget (NAME at several)")
    ap.add_argument("--merge", action="store_true",
                    help="pool the folders (one run split over folders by task): a row per "
                         "policy over all their tasks; a task in two folders counts once")
    ap.add_argument("--metric", choices=("acc", "acc_norm"), default="acc",
                    help="what the paired gap compares (the table shows both)")
    args = ap.parse_args()
    if args.merge and ":" in (args.paired or ""):
        ap.error("--merge pools the folders, so --paired cannot name one")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for d in args.dirs:
        data = json.loads((Path(d) / "results.json").read_text())
        for rec in data["results"].values():
            if rec.get("kind") not in ("mc", "matched") or not rec.get("complete", True):
                continue
            folder = "merged" if args.merge else Path(d).name
            key = (folder, rec["kind"], rec["policy"], str(rec["budget"]), rec["mode"])
            if not any(r["task"] == rec["task"] for r in groups[key]):
                groups[key].append(rec)
    # FOLDER:NAME pairs with NAME's records in that results folder only (two gates side by side)
    ref_dir, _, ref_policy = (args.paired or "").rpartition(":")
    ref_dirs = set(ref_dir.split(",")) if ref_dir else set()

    def is_reference(key: tuple) -> bool:
        return key[2] == ref_policy and (not ref_dirs or key[0] in ref_dirs)

    # keyed by mode, and by budget too with --same-budget
    def pair_key(key: tuple) -> tuple:
        return key[4], key[3] if args.same_budget else None

    paired: dict[tuple, list[dict]] = {}
    for key, recs in groups.items():
        if is_reference(key):
            pooled = paired.setdefault(pair_key(key), [])
            pooled += [r for r in recs if all(p["task"] != r["task"] for p in pooled)]
    extra = (f" {args.metric} gap vs paired, 95% CI (shared examples) |" if args.paired
             else "")
    print("| results | kind | policy | budget | mode | tasks | examples | acc % | acc_norm % | "
          "%Evict |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.paired else ""))
    for key in sorted(groups):
        recs = groups[key]
        acc, norm, evict = (sum(r[f] for r in recs) / len(recs)
                            for f in ("acc", "acc_norm", "evict_pct"))
        cell = ""
        if args.paired:
            ref = paired.get(pair_key(key))
            if ref is None and args.any_mode:
                ref = next((r for (_, b), r in paired.items() if b == pair_key(key)[1]), None)
            if ref is None or is_reference(key):
                cell = " |"
            else:
                gap, half, n = paired_gap(ref, recs, args.metric)
                cell = (f" {gap:+.2f} [{gap - half:+.2f}, {gap + half:+.2f}] (n={n}) |" if n
                        else " - (no shared per-example records) |")
        print(f"| {' | '.join(key)} | {len(recs)} | {sum(r['n'] for r in recs)} | "
              f"{acc:.2f} | {norm:.2f} | {evict:.2f} |" + cell)


if __name__ == "__main__":
    main()
