"""Average accuracy and %Evict per policy over tasks from one or more results.json files.

    python bench/summarize_mc.py results/mc_base_050 [results/mc_cpt_demo ...] [--split-by mode]

Prints a markdown table: policy, budget, tasks, examples, mean acc, mean acc_norm, mean %Evict
(task-level means, each task weighted equally, as the papers' averages are).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for d in args.dirs:
        data = json.loads((Path(d) / "results.json").read_text())
        for rec in data["results"].values():
            if rec.get("kind") not in ("mc", "matched") or not rec.get("complete", True):
                continue
            key = (Path(d).name, rec["kind"], rec["policy"], str(rec["budget"]), rec["mode"])
            groups[key].append(rec)
    print("| results | kind | policy | budget | mode | tasks | examples | acc % | acc_norm % | %Evict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(groups):
        recs = groups[key]
        acc, norm, evict = (sum(r[f] for r in recs) / len(recs)
                            for f in ("acc", "acc_norm", "evict_pct"))
        print(f"| {' | '.join(key)} | {len(recs)} | {sum(r['n'] for r in recs)} | "
              f"{acc:.2f} | {norm:.2f} | {evict:.2f} |")


if __name__ == "__main__":
    main()
