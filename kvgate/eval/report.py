"""Evaluation outputs: a resumable JSON of every number, a markdown table and PNG plots.

``results.json`` layout::

    {"meta": {"model": ..., ...},
     "results": {KEY: {"kind": "mc"|"needle"|"ppl"|"ruler"|"longbench", "complete": bool,
                       <summary numbers>,
                       "spec": {"policy": NAME, "options": {...}},
                       "examples": {uid: {<per-example numbers>}}}}}

A KEY names one (kind, task, policy, budget, mode) run, e.g. ``mc|rte|snapkv|0.5|masked``;
its policy part is the run's label (``snap10=snapkv`` stores ``snap10``), and ``spec`` holds
what that label ran, so a resumed key never mixes two option sets (older files lack it).
``settings`` holds every other setting that changes its scores (``--max-length``, ``--dtype``,
...), each example the digest of its tokens (``input``), and ``meta`` the model's identity: a
run that differs in any of them is refused in one line (:mod:`kvgate.eval.identity`).
The file is rewritten atomically after every batch (at most every ``flush_s`` seconds) and
when a key completes, so an interrupted run keeps its finished keys *and* the examples of the
key it was in; a second run skips complete keys and finished examples.

Several runs may share one folder at once (e.g. two budgets side by side): each save takes an
exclusive lock, re-reads the file and merges: the keys this run has stored are its own, every
other key is the file's, so no run overwrites the keys of another (a key two runs both work on
holds the copy saved last).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvgate.data.cache import read_json, write_json_atomic
from kvgate.eval.errors import EvalError
from kvgate.eval.identity import check_settings, normal
from kvgate.eval.plots import depth_heatmap, draw_series, pyplot, save_figure
from kvgate.eval.shape import check_results
from kvgate.policies.base import Budget

RESULTS = "results.json"
TABLE = "results.md"
LOCK = ".results.json.lock"

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one run per folder there
    fcntl = None


@contextlib.contextmanager
def _folder_lock(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    # the lock file stays behind on purpose: removing it would let a waiting run lock a file
    # that no longer has a name while a newcomer locks a new one
    with open(folder / LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def budget_label(budget: Budget | None) -> str:
    """``0.5`` for a ratio, ``128t`` for tokens, ``none`` when the policy ignores budgets."""
    if budget is None:
        return "none"
    return f"{budget.ratio:g}" if budget.ratio is not None else f"{budget.tokens}t"


def make_key(kind: str, task: str, policy: str, budget: str, mode: str) -> str:
    return f"{kind}|{task}|{policy}|{budget}|{mode}"


def split_key(key: str) -> dict[str, str]:
    kind, task, policy, budget, mode = key.split("|")
    return {"kind": kind, "task": task, "policy": policy, "budget": budget, "mode": mode}


class ResultStore:
    """The results JSON of one output folder (see the module docstring).

    ``meta`` identifies what produced the numbers (model, checkpoint, a digest of its
    ``weights``); a folder holding results of a different model is refused, so numbers never
    mix (a folder written before ``weights`` was stored takes it as it is). ``settings``: the
    run's score-changing settings, stored with every key it puts and checked against a key it
    resumes (``check_spec``); None checks and stores none.
    """

    def __init__(self, out_dir: str | Path, meta: dict[str, Any], flush_s: float = 30.0,
                 settings: dict[str, Any] | None = None) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / RESULTS
        self.flush_s = flush_s
        self._last = -math.inf  # the first partial state is written at once
        self._meta = dict(meta)
        self.settings = None if settings is None else normal(settings)
        self._touched: set[str] = set()  # keys this run has put; the others are the file's
        self._unsaved = False  # a key was put since the last write (flush() writes it)
        self.data = self._read() or {"meta": dict(meta), "results": {}}
        if meta.get("weights") is not None:  # a folder written before the digest gains it
            self.data["meta"].setdefault("weights", meta["weights"])

    def _read(self) -> dict[str, Any] | None:
        """The file's contents, checked to come from the same model and checkpoint."""
        if not self.path.exists():
            return None
        data = read_json(self.path)
        if data is None:
            raise EvalError(f"{self.path} exists but is not readable JSON of results; move it "
                            "away")
        check_results(self.path, data)  # the shape too: one line, not a traceback later
        old = data.setdefault("meta", {})
        for field in ("model", "checkpoint", "others_on", "weights"):
            if field == "weights" and None in (old.get(field), self._meta.get(field)):
                continue  # a folder (or a loader) without the digest: taken as it is
            if old.get(field) == self._meta.get(field):
                continue
            if field == "weights":
                raise EvalError(f"{self.path} holds results of other weights (digest "
                                f"{old[field]}, now {self._meta[field]}): the model or "
                                "checkpoint changed since; use another --out folder")
            raise EvalError(f"{self.path} holds results of {field} {old.get(field)!r}, not "
                            f"{self._meta.get(field)!r}; use another --out folder")
        return data

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return self.data["results"]

    def is_complete(self, key: str) -> bool:
        return bool(self.results.get(key, {}).get("complete"))

    def check_spec(self, key: str, spec: dict[str, Any] | None) -> None:
        """EvalError if ``key`` is stored with other settings than this run's, or with another
        policy spec than ``spec`` (records written before specs were stored have none and are
        taken as they are)."""
        check_settings(self.path, key, self.results.get(key), self.settings)
        stored = self.results.get(key, {}).get("spec")
        if spec is None or stored is None or stored == spec:
            return
        label = split_key(key)["policy"]
        raise EvalError(f"{self.path} holds {key} scored with {stored['policy']} options "
                        f"{stored['options']}, but this run's {label!r} is {spec['policy']} with "
                        f"{spec['options']}: give it another label (LABEL=POLICY) or --out folder")

    def examples(self, key: str) -> dict[str, Any]:
        """Per-example records already stored under ``key`` (a copy)."""
        return dict(self.results.get(key, {}).get("examples", {}))

    def has_example(self, key: str, uid: str) -> bool:
        """Whether ``key`` has a stored record of example ``uid`` (no copy of the records)."""
        return uid in self.results.get(key, {}).get("examples", {})

    def put(self, key: str, summary: dict[str, Any], examples: dict[str, Any],
            complete: bool) -> None:
        """Store a key's state; written now when complete, else at most every ``flush_s``."""
        settings = {} if self.settings is None else {"settings": self.settings}
        self.results[key] = {**split_key(key), **summary, **settings, "complete": complete,
                             "examples": examples}
        self._touched.add(key)
        self._unsaved = True
        if complete or time.monotonic() - self._last >= self.flush_s:
            self.save()

    def flush(self) -> None:
        """Write what was put since the last write (a run ending early: Ctrl-C); nothing when
        nothing was, so an interrupt before the first result creates no file."""
        if self._unsaved:
            self.save()

    def save(self) -> None:
        """Merge this run's keys into the file as it is now, under the folder's lock."""
        with _folder_lock(self.dir):
            disk = self._read()
            if disk is not None:
                merged = disk["results"]
                for key, mine in self.results.items():
                    if key in self._touched or key not in merged:
                        merged[key] = mine
                self.data["results"] = merged
            write_json_atomic(self.path, self.data)
        self._last = time.monotonic()
        self._unsaved = False

    def complete_results(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.results.values()
                if r.get("complete") and (kind is None or r.get("kind") == kind)]


# ---------------------------------------------------------------------------------------------
# summaries


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(results: Iterable[dict[str, Any]]) -> str:
    """One markdown table per result kind, every complete key a row."""
    from kvgate.eval.columns import table

    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r)
    cols = {
        "mc": [("task", "task"), ("policy", "policy"), ("budget", "budget"), ("mode", "mode"),
               ("n", "n"), ("acc", "acc %"), ("acc_norm", "acc_norm %"),
               ("evict_pct", "%Evict"), ("evict_pct_tokens", "%Evict (token-weighted)")],
        "needle": [("task", "length|depth"), ("policy", "policy"), ("budget", "budget"),
                   ("mode", "mode"), ("n", "n"), ("acc", "acc %"), ("evict_pct", "%Evict")],
        "ppl": [("task", "corpus"), ("policy", "policy"), ("budget", "budget"),
                ("mode", "mode"), ("n", "n"), ("tokens", "scored tokens"), ("ppl", "ppl"),
                ("evict_pct", "%Evict")],
    }
    parts = []
    for kind in ("mc", "needle", "ppl"):
        rows = sorted(by_kind.get(kind, []), key=lambda r: (r["task"], r["policy"], r["budget"],
                                                            r["mode"]))
        if not rows:
            continue
        spec = cols[kind]
        # with the needle's question-answering columns where its runs have them
        lines = table(kind, "| " + " | ".join(h for _, h in spec) + " |", rows,
                      lambda r, spec=spec: "| " + " | ".join(_fmt(r.get(k)) for k, _ in spec)
                      + " |")
        parts.append("\n".join(lines))
    from kvgate.eval.ruler.report import ruler_markdown

    ruler = ruler_markdown(list(by_kind.get("ruler", [])))
    if ruler:
        parts.append(ruler)
    from kvgate.eval.longbench.report import longbench_markdown

    longbench = longbench_markdown(list(by_kind.get("longbench", [])))
    if longbench:
        parts.append(longbench)
    return "\n\n".join(parts) + "\n"


def write_table(store: ResultStore) -> Path:
    path = store.dir / TABLE
    path.write_text(markdown_table(store.complete_results()), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# plots (matplotlib, Agg backend: no display needed)


def plot_accuracy_vs_eviction(results: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Accuracy against %Evict, one panel per task (plus the task mean), one series per
    policy (points joined in eviction order). None when there is nothing to plot."""
    mc = [r for r in results if r.get("kind") == "mc" and r.get("acc") is not None]
    if not mc:
        return None
    plt = pyplot()
    tasks = sorted({r["task"] for r in mc})
    panels = tasks + (["mean"] if len(tasks) > 1 else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, task in zip(axes[0], panels):
        if task == "mean":
            groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
            for r in mc:
                groups[(r["policy"], r["budget"], r["mode"])].append(r)
            rows = [{"policy": p, "acc": sum(x["acc"] for x in g) / len(g),
                     "evict_pct": sum(x["evict_pct"] for x in g) / len(g)}
                    for (p, _, _), g in groups.items() if len(g) == len(tasks)]
        else:
            rows = [r for r in mc if r["task"] == task]
        draw_series(ax, rows, "acc", task, "accuracy %")
    return save_figure(plt, fig, axes, path)


def plot_ppl_vs_eviction(results: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Perplexity against %Evict (a log axis where it spans more than 3x), one panel per
    text and context, one series per policy (points joined in eviction order: a policy run at
    several keep thresholds or budgets becomes a curve). None when there is nothing to plot."""
    ppl = [r for r in results if r.get("kind") == "ppl" and r.get("ppl") is not None]
    if not ppl:
        return None
    plt = pyplot()
    tasks = sorted({r["task"] for r in ppl})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in ppl if r["task"] == task]
        draw_series(ax, rows, "ppl", task, "perplexity")
        values = [r["ppl"] for r in rows]
        if max(values) > 3 * min(values):  # a log axis only where one is needed to see both ends
            ax.set_yscale("log")
    return save_figure(plt, fig, axes, path)


def plot_needle_heatmaps(results: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One heatmap (context length x needle depth -> accuracy) per (policy, budget, mode)."""
    needle = [r for r in results if r.get("kind") == "needle" and r.get("acc") is not None]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in needle:
        groups[(r["policy"], r["budget"], r["mode"])].append(r)
    if not groups:
        return []
    paths = []
    for (policy, budget, mode), rows in sorted(groups.items()):
        lengths = sorted({int(r["length"]) for r in rows})
        depths = sorted({float(r["depth"]) for r in rows})
        grid = [[math.nan] * len(depths) for _ in lengths]
        for r in rows:
            grid[lengths.index(int(r["length"]))][depths.index(float(r["depth"]))] = r["acc"]
        path = Path(out_dir) / f"needle_{policy}_{budget}_{mode}.png".replace("/", "_")
        paths.append(depth_heatmap(grid, lengths, depths, f"{policy} ({budget}, {mode})",
                                   "accuracy %", path))
    return paths


def plot_eviction_pattern(keep: Any, path: str | Path, title: str = "",
                          tokens: Sequence[str] | None = None) -> Path:
    """Which (layer, token) entries a policy kept, one panel per KV head (like Figure 1 of
    the Attention-Gate paper). ``keep``: [L, H_kv, n] bool (tensor or nested lists)."""
    import numpy as np

    keep = np.asarray(keep.cpu() if hasattr(keep, "cpu") else keep, dtype=float)
    if keep.ndim != 3:
        raise EvalError(f"eviction pattern must be [layers, kv_heads, tokens], got {keep.shape}")
    plt = pyplot()
    layers, heads, n = keep.shape
    fig, axes = plt.subplots(heads, 1, figsize=(min(18, 2 + 0.12 * n), 0.6 + 0.25 * layers * heads
                                                 + 0.4 * heads), squeeze=False)
    for h in range(heads):
        ax = axes[h][0]
        ax.imshow(keep[:, h, :], cmap="Greys_r", vmin=0, vmax=1, aspect="auto",
                  interpolation="nearest")
        ax.set_ylabel(f"head {h}\nlayer")
        if tokens is not None and len(tokens) == n and n <= 120:
            labels = ["".join(c if c.isprintable() else "?" for c in str(t)) for t in tokens]
            ax.set_xticks(range(n), labels, rotation=90, fontsize=5)
        else:
            ax.set_xlabel("token")
    kept = keep.mean() * 100
    fig.suptitle(f"{title} kept {kept:.1f}% (white = kept, black = evicted)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(store: ResultStore) -> list[Path]:
    """Markdown table and every plot the stored results allow; returns the files written."""
    store.save()
    results = store.complete_results()
    paths = [write_table(store)]
    acc = plot_accuracy_vs_eviction(results, store.dir / "accuracy_vs_eviction.png")
    if acc is not None:
        paths.append(acc)
    ppl = plot_ppl_vs_eviction(results, store.dir / "ppl_vs_eviction.png")
    if ppl is not None:
        paths.append(ppl)
    paths.extend(plot_needle_heatmaps(results, store.dir))
    from kvgate.eval.ruler.report import plot_ruler_accuracy, plot_ruler_heatmaps

    paths.extend(plot_ruler_accuracy(results, store.dir))
    paths.extend(plot_ruler_heatmaps(results, store.dir))
    from kvgate.eval.longbench.report import plot_longbench_accuracy

    paths.extend(plot_longbench_accuracy(results, store.dir))
    return paths
