"""Print chosen TensorBoard scalars of a run as a markdown table (first, every Nth, last step).

    python experiments/tb_summary.py runs/cpt_demo/tb [--tags train/lm_loss train/retention] [--every 20]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

DEFAULT_TAGS = ["train/lm_loss", "train/distill_kl", "train/beta", "train/retention",
                "train/evict_pct", "val/lm_loss", "val/evict_pct", "val/acc"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logdir")
    ap.add_argument("--tags", nargs="+", default=DEFAULT_TAGS)
    ap.add_argument("--every", type=int, default=20)
    args = ap.parse_args()
    runs = sorted({p.parent for p in Path(args.logdir).rglob("events.out.tfevents.*")})
    series: dict[str, dict[int, float]] = {}
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if tag in args.tags:
                series.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    tags = [t for t in args.tags if t in series]
    steps = sorted({s for t in tags for s in series[t]})
    # first step, the first logged step of every `every`-step bucket, last step
    keep = [s for i, s in enumerate(steps)
            if i == 0 or s == steps[-1] or s // args.every != steps[i - 1] // args.every]
    print("| step | " + " | ".join(tags) + " |")
    print("|---" * (len(tags) + 1) + "|")
    for s in keep:
        cells = [f"{series[t][s]:.4g}" if s in series[t] else "" for t in tags]
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
