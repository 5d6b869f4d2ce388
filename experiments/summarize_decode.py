"""Decode-time eviction (docs/RESULTS.md section 2): each policy's perplexity, what its cache
holds at the end (where recorded) and the gate's per-token NLL gap to it, with a 95% t interval
over the windows (the same windows for all).

    python experiments/summarize_decode.py experiments/results/ppl_decode [--gate local_gate]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from scipy.stats import t as student_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    parser.add_argument("--gate", default="local_gate")
    args = parser.parse_args()
    results = json.loads((Path(args.folder) / "results.json").read_text())["results"]
    def label(key):  # policy, with its budget where it has one (a policy may run at several)
        _, _, policy, budget, _ = key.split("|")
        return policy if budget == "none" else f"{policy}@{budget}"

    recs = {label(key): r for key, r in results.items()}
    gate = recs[args.gate]["examples"]

    def nll(r):  # per token, per window
        return {u: -e["ll"][0] / e["tokens"][0] for u, e in r["examples"].items()}

    mine = nll(recs[args.gate])
    print("| policy | PPL | %Evict | held at end % | gate - policy, NLL per token [95% t] "
          "| windows the gate wins |")
    print("|---|---|---|---|---|---|")
    for name, r in recs.items():
        held = r.get("held_end_pct")
        row = (f"| {name} | {r['ppl']:.3f} | {r['evict_pct']:.1f} | "
               f"{'-' if held is None else f'{held:.1f}'} |")
        if name == args.gate:
            print(row + " | |")
            continue
        theirs = nll(r)
        diffs = [mine[u] - theirs[u] for u in gate if u in theirs]
        mean = statistics.mean(diffs)
        half = student_t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        wins = sum(d < 0 for d in diffs)
        print(f"{row} {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] | {wins} of {len(diffs)} |")


if __name__ == "__main__":
    main()
