"""Markdown table of the issue-#7 ablation: each gate's held-out perplexity at a fixed context
next to the heuristics at the kept ratio nearest to the gate's own eviction.

    python experiments/summarize_ablation.py experiments/results/ppl_ctx256 [more folders ...]

Each folder holds ``gate_<run>/results.json`` (one gated checkpoint each, from
``experiments/run_results.sh pplctx``) and ``heuristics/results.json`` (base model: ``full`` and
the heuristics at one or more kept ratios). A heuristic is reported at the budget whose measured
%Evict is closest to the gate's; the gap is printed so a mismatch is visible. Every heuristic
perplexity is taken over the gate's own windows; one scored on fewer of them is marked
``(k/N windows)`` and not taken as the best (its number is over other text). So is one whose
nearest budget is more than ``--max-evict-gap`` points of %Evict (default 2) from the gate's,
marked ``(N points off)``: a heuristic not scored near the gate's eviction is no match for it
(at 10 points less eviction it would flatter the heuristic, at 10 more the gate). The last
column pairs the gate with the best of those heuristics window by window: a 95% interval that
excludes 0 is a difference the sample can resolve.

Gates trained with other seeds (``gate_<run>_seed<k>``, e.g. from ``experiments/run_results.sh
pplseed``) are also pooled, with their seed-0 run (``gate_<run>``) where there is one, in a second
table (two or more seeds make a row): each seed's paired gap, their mean with a t interval over
seeds (whether the *recipe*, not one trained gate, beats the heuristic), and the seeds'
average gap per window with an interval over windows (these trained gates held fixed).

``--plot DIR`` also draws perplexity against %Evict per folder (heuristic curves over their
budgets, a gate's keep thresholds as its curve), every point over the same windows:

    python experiments/summarize_ablation.py experiments/results/ppl_ctx256 --plot docs/figures \
        --runs '^abl_recent64_256'

experiments/results keeps the per-window records only for the gates of docs/RESULTS.md and the
heuristic budgets they pair with; a gate stored without them is listed with its own numbers
alone, a heuristic without them as ``- @ %Evict (no per-window records)``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

# the heuristics every ablation folder scores; any other one a folder holds (Ada-KV, PyramidKV,
# ...) gets a column after these and can be the best heuristic too
HEURISTICS = ("h2o", "snapkv", "streaming", "random")
# points of %Evict between a gate and a heuristic's nearest budget beyond which the heuristic
# is not a match: a kept ratio is chosen to 0.01, and rounding to whole tokens per head moves
# a 256-token prompt's eviction by up to ~1 point
MAX_EVICT_GAP = 2.0


def load(path: Path) -> dict:
    return json.loads(path.read_text())["results"] if path.is_file() else {}


def ppl_over(rec: dict, uids: set[str]) -> float:
    """Perplexity of ``rec`` over the windows ``uids`` (those it has)."""
    ex = [r for u, r in rec.get("examples", {}).items() if u in uids]
    tokens = sum(r["tokens"][0] for r in ex)
    return math.exp(-sum(r["ll"][0] for r in ex) / tokens) if tokens else math.nan


# two-sided 95% t quantiles by degrees of freedom, for intervals over a handful of seeds
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
SEED = re.compile(r"_seed\d+")


def window_gaps(gate: dict, heur: dict) -> dict[str, float]:
    """Gate minus heuristic in per-token NLL (= log-perplexity), window by window, over the
    windows both scored."""
    a, b = gate.get("examples", {}), heur.get("examples", {})
    return {u: (-a[u]["ll"][0] + b[u]["ll"][0]) / a[u]["tokens"][0] for u in a if u in b}


def mean_ci(diffs: list[float]) -> tuple[float, float, int] | None:
    """Mean, half-width of a normal 95% interval over the items (windows are equally long),
    and their number."""
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, 1.96 * math.sqrt(var / len(diffs)), len(diffs)


def fmt_gap(gap: tuple[float, float, int] | None) -> str:
    if gap is None:
        return "-"
    mean, half, n = gap
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}] (n={n})"


def table(folder: Path, max_gap: float = MAX_EVICT_GAP) -> list[str]:
    heur = load(folder / "heuristics" / "results.json")
    full = [r for r in heur.values() if r["policy"] == "full" and r.get("complete")]
    names = HEURISTICS + tuple(sorted({r["policy"] for r in heur.values()}
                                      - {"full", *HEURISTICS}))
    rows = []
    task = None
    # run -> (gap per window, best heuristic's name, gate %Evict): the seed table
    gaps: dict[str, tuple] = {}
    for gate_file in sorted(folder.glob("gate_*/results.json")):
        for rec in load(gate_file).values():
            task = rec["task"]
            run = gate_file.parent.name.removeprefix("gate_")
            line = [run, f"{rec['evict_pct']:.1f}",
                    f"{rec['ppl']:.3f}" if rec.get("complete") else
                    f"{rec['ppl']:.3f} (partial {rec['n']})"]
            best, best_ppl, uids = None, math.inf, set(rec.get("examples", {}))
            if not uids:  # per-window records not kept: the gate's own numbers only
                rows.append("| " + " | ".join(line + ["-"] * (len(names) + 2)) + " |")
                continue
            for name in names:
                cands = [r for r in heur.values() if r["policy"] == name and r.get("complete")]
                if not cands:
                    line.append("-")
                    continue
                near = min(cands, key=lambda r: abs(r["evict_pct"] - rec["evict_pct"]))
                if not near.get("examples"):
                    line.append(f"- @ {near['evict_pct']:.1f} (no per-window records)")
                    continue
                near_ppl = ppl_over(near, uids)
                have = len(uids & set(near.get("examples", {})))
                # a heuristic scored on fewer windows than the gate is shown, marked, and not
                # taken as the best: its number is over other text
                short = "" if have == len(uids) else f" ({have}/{len(uids)} windows)"
                off = abs(near["evict_pct"] - rec["evict_pct"])
                far = f" ({off:.1f} points off)" if off > max_gap else ""
                line.append(f"{near_ppl:.3f} @ {near['evict_pct']:.1f}{short}{far}")
                if not short and not far and (best is None or near_ppl < best_ppl):
                    best, best_ppl = near, near_ppl
            gap = "-" if best is None else f"{rec['ppl'] - best_ppl:+.3f}"
            per_window = {} if best is None else window_gaps(rec, best)
            paired = mean_ci(list(per_window.values()))
            if paired is not None:
                gaps[run] = (per_window, best["policy"], rec["evict_pct"])
            rows.append("| " + " | ".join(line + [gap, fmt_gap(paired)]) + " |")
    head = [f"context {folder.name} ({task}); base model PPL "
            + (f"{full[0]['ppl']:.3f} over {full[0]['tokens']:,} tokens" if full else "n/a"),
            "",
            "| gate (run) | gate %Evict | gate PPL | " + " | ".join(
                f"{h} PPL @ %Evict" for h in names)
            + " | gate - best heuristic | paired log-PPL gap, 95% CI |",
            "|---" * (5 + len(names)) + "|"]
    return head + rows + [""] + seed_table(gaps)


def seed_table(gaps: dict[str, tuple]) -> list[str]:
    """Runs that differ only in a ``_seed<k>`` part, pooled. Two intervals: a t interval over
    the seeds' mean gaps, which carries the spread between trainings (what a new seed of the
    recipe would do; wide with few seeds), and one over windows of the seeds' average gap per
    window, which holds these trained gates fixed and only samples the text."""
    groups: dict[str, list[str]] = {}
    for run in gaps:
        groups.setdefault(SEED.sub("", run), []).append(run)
    for runs in groups.values():  # seed 0 (no _seed part) first, then by seed
        runs.sort(key=lambda r: int(m.group()[5:]) if (m := SEED.search(r)) else 0)
    rows = []
    for recipe, runs in sorted(groups.items()):
        if len(runs) < 2:  # seeds pool without seed 0 too (its gate may be elsewhere)
            continue
        paired = {r: mean_ci(list(gaps[r][0].values())) for r in runs}
        means = [paired[r][0] for r in runs]
        k = len(means)
        mean = sum(means) / k
        sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (k - 1))
        half = T95.get(k - 1, 1.96) * sd / math.sqrt(k)
        shared = set.intersection(*(set(gaps[r][0]) for r in runs))
        fixed = fmt_gap(mean_ci([sum(gaps[r][0][u] for r in runs) / k for u in sorted(shared)]))
        below = sum(paired[r][0] + paired[r][1] < 0 for r in runs)
        above = sum(paired[r][0] - paired[r][1] > 0 for r in runs)
        per_seed = "; ".join(f"{r} ({gaps[r][2]:.1f}% evicted): {fmt_gap(paired[r])} vs "
                             f"{gaps[r][1]}" for r in runs)
        rows.append(f"| {recipe} | {k} | {per_seed} | {mean:+.4f} "
                    f"[{mean - half:+.4f}, {mean + half:+.4f}] | {fixed} | "
                    f"{below} below, {above} above |")
    if not rows:
        return []
    return ["the same recipe over seeds (gate - best heuristic, log-PPL)", "",
            ("| recipe | seeds | each seed's paired gap, 95% CI over windows | mean over seeds, "
             "95% t CI over seeds | mean over seeds, 95% CI over windows (these gates) | "
             "seeds resolved below / above 0 |"), "|---" * 6 + "|",
            *rows, ""]


TAU = re.compile(r"_tau\d+")
CURVES = ("full", "h2o", "snapkv", "streaming")


def curve_records(folder: Path, runs: re.Pattern | None = None) -> tuple[list[dict], list[str]]:
    """Perplexity against eviction over one text: the heuristics at every budget they were run
    at (``random`` left out: an order of magnitude above the rest, it would flatten them) and
    the gates whose run matches ``runs``, one series per trained gate (its ``_tau<k>`` rows,
    the same checkpoint at other keep thresholds, join it). Every point is re-scored over the
    windows all the plotted gates share, so the curves are over the same text; a heuristic
    record without all of them is left out and named in the second return value."""
    gates = []
    for gate_file in sorted(folder.glob("gate_*/results.json")):
        run = gate_file.parent.name.removeprefix("gate_")
        if runs is None or runs.search(run):
            gates += [(TAU.sub("", run), rec) for rec in load(gate_file).values()
                      if rec.get("complete")]
    uids = set.intersection(*(set(rec.get("examples", {})) for _, rec in gates)) if gates else set()
    if not uids:  # no gate, or gates over disjoint text: no curve can be drawn over one text
        return [], []
    points = [{"kind": "ppl", "task": rec["task"], "policy": f"gate {series}",
               "evict_pct": rec["evict_pct"], "ppl": ppl_over(rec, uids)} for series, rec in gates]
    skipped = []
    for rec in load(folder / "heuristics" / "results.json").values():
        if rec["policy"] not in CURVES or not rec.get("complete"):
            continue
        if uids <= set(rec.get("examples", {})):
            points.append({"kind": "ppl", "task": rec["task"], "policy": rec["policy"],
                           "evict_pct": rec["evict_pct"], "ppl": ppl_over(rec, uids)})
        else:
            skipped.append(f"{rec['policy']} @ {rec['evict_pct']:.1f}%")
    return points, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, metavar="DIR",
                        help="also draw <DIR>/<folder>_vs_eviction.png: perplexity against "
                             "%%Evict for the heuristics and the gates over the same windows")
    parser.add_argument("--max-evict-gap", type=float, default=MAX_EVICT_GAP, metavar="POINTS",
                        help="a heuristic whose nearest budget is further than this from the "
                             "gate's %%Evict is shown, marked, and not taken as the best "
                             "(default %(default)s)")
    parser.add_argument("--runs", type=re.compile, metavar="REGEX",
                        help="with --plot: only the gate runs this regex matches")
    args = parser.parse_args()
    for folder in args.folders:
        print("\n".join(table(folder, args.max_evict_gap)))
        if args.plot is not None:
            from kvgate.eval.benchmarks.ppl.report import plot_ppl_vs_eviction

            points, skipped = curve_records(folder, args.runs)
            args.plot.mkdir(parents=True, exist_ok=True)
            path = plot_ppl_vs_eviction(points, args.plot / f"{folder.name}_vs_eviction.png")
            if path is None:
                print(f"plot: nothing drawn for {folder}: no complete gate run matched, or the "
                      "matched ones share no window")
            else:
                print(f"plot: {path}" + (f" (without {', '.join(skipped)}: fewer windows)"
                                         if skipped else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
