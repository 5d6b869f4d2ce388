"""Compress + answer time of each eviction policy, per context length, as a ratio to the full cache.

    python bench/bench_long_context.py --lengths 1024,2048,4096 \
        --policies full,snapkv,h2o,tova,streaming,attention_gate --budget 0.5 --repeats 3 \
        [--checkpoint runs/cpt_recipe/gated] [--policy-opt gate_rank.allocation=global] \
        [--profile] [--json out.json]

Setting of the field (kvpress, RULER): one ``niah_single_1`` context of exactly ``length`` tokens
is compressed without its question (``Engine.compress``), then the question is asked over the
compressed cache (``Engine.answer``, greedy, ``--max-new-tokens``). Every policy runs on the same
examples; within one repeat the policies run one after the other, in an order that rotates each
repeat, so a machine shared with other jobs slows them alike. The table gives medians over
repeats and ``x full`` = total / total of ``full`` at that length (ratios, not absolute claims).

``attention_gate`` and ``local_gate`` need a gated model: ``--checkpoint DIR`` (an export,
``kvgate.load_gated``), or else an untrained Attention-Gate is patched onto a copy of the base
(``kvgate.patch``). Its cost does not depend on the gate's weights, only on how much it evicts
(the ``kept`` column: an untrained gate keeps nearly everything, so its answer time is the full
cache's, not a trained gate's).

``--profile``: the gated prefill at the largest length, once more, under a timer split (the
gate's own attention over the prefix, the eq.-5 masked prefill attention ``eq5_attention``
(blocked for causal + padding masks), the compaction of the cache, the rest of the model)
and ``torch.profiler``'s top ops by self CPU time. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate
from kvgate.eval.benchmarks.ruler.tasks import generate
from kvgate.eval.config import parse_policies
from kvgate.eval.errors import EvalError
from kvgate.policies import Policy, policy_class


def reads_gate(policy: str) -> bool:
    """Whether the policy named ``policy`` reads a gated model's gates (``Policy.needs_gate``)."""
    return policy_class(policy).needs_gate


UNTRAINED_NOTE = ("attention_gate: untrained gate (kvgate.patch on the base); the cost does not "
                  "depend on the gate's weights, only on how much it evicts (see kept)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--policies", default="full,snapkv,h2o,tova,streaming,attention_gate")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--policy-opt", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="an option of one of --policies, as kvgate eval takes it (repeatable)")
    ap.add_argument("--checkpoint", default=None, help="gated export for attention_gate")
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.policies = [p for p in args.policies.split(",") if p]
    if "full" not in args.policies:
        args.policies.insert(0, "full")  # the reference of every ratio
    try:  # kvgate eval's own parsing: options checked, one-line errors
        args.built = parse_policies(args.policies, args.policy_opt)
    except EvalError as err:
        ap.error(str(err))
    return args


def load_models(args):
    """(base, gated or None, tokenizer, note)."""
    need_gate = any(reads_gate(p) for p in args.policies)
    if args.checkpoint:
        gated, tok, _ = kvgate.load_gated(args.checkpoint)
        base = None
        if [p for p in args.policies if not reads_gate(p)]:
            base, _ = kvgate.load_base(args.base)
        return base, gated, tok, f"gated policies: gated export {args.checkpoint}"
    base, tok = kvgate.load_base(args.base)
    if not need_gate:
        return base, None, tok, ""
    gated = copy.deepcopy(base)
    torch.manual_seed(0)
    kvgate.patch(gated, kvgate.GateConfig())
    gated.eval()
    return base, gated, tok, UNTRAINED_NOTE


def engine_for(policy: Policy, base, gated, tok, budget: float):
    model = gated if policy.needs_gate else base
    return kvgate.Engine(model, tok, policy, budget)


def run_once(engine, ex, max_new_tokens: int) -> tuple[float, float, float, str]:
    t0 = time.perf_counter()
    compressed = engine.compress([ex.context])
    t1 = time.perf_counter()
    out = engine.answer(compressed, [ex.question], max_new_tokens=max_new_tokens,
                        answer_prefix=ex.answer_prefix)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compressed.kept_fraction, out[0]


def measure(args, base, gated, tok) -> list[dict]:
    rows = []
    for n in args.lengths:
        ex = generate(args.task, tok, n, seed=0)
        engines = {p: engine_for(args.built[p], base, gated, tok, args.budget)
                   for p in args.policies}
        for p in args.policies:  # warm-up, untimed
            run_once(engines[p], ex, 1)
        times = {p: [] for p in args.policies}
        for r in range(args.repeats):
            k = r % len(args.policies)
            for p in args.policies[k:] + args.policies[:k]:  # rotate: side by side, fair order
                times[p].append(run_once(engines[p], ex, args.max_new_tokens))
        full = statistics.median(c + a for c, a, _, _ in times["full"])
        for p in args.policies:
            c = statistics.median(t[0] for t in times[p])
            a = statistics.median(t[1] for t in times[p])
            tot = statistics.median(t[0] + t[1] for t in times[p])
            hit = any(ans in times[p][-1][3] for ans in ex.answers)
            rows.append({"length": n, "policy": p, "compress_s": c, "answer_s": a, "total_s": tot,
                         "x_full": tot / full, "kept": times[p][-1][2], "answer_hit": hit,
                         "repeats": args.repeats})
            print(f"{n:>6} | {p:<15} | {c:>10.3f} | {a:>8.3f} | {tot:>7.3f} | {tot / full:>6.2f}"
                  f" | {times[p][-1][2]:>5.2f} | {hit}", flush=True)
    return rows


class _Split:
    """Accumulated wall time of wrapped functions (a timer split of one prefill)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            with torch.profiler.record_function(f"kvgate::{label}"):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        self.undo.append((owner, name, fn))

    def restore(self) -> None:
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)
        self.undo.clear()


def profile_gated_prefill(args, gated, tok) -> dict:
    import kvgate.cache.compressed as compressed_mod
    import kvgate.policies.attention_gate as ag_mod
    from kvgate.cache.ragged import RaggedStore

    n = max(args.lengths)
    ex = generate(args.task, tok, n, seed=0)
    engine = kvgate.Engine(gated, tok, "attention_gate", args.budget)
    engine.compress([ex.context])  # warm-up
    split = _Split()
    split.wrap(ag_mod, "compute_gate", "gate attention (compute_gate)")
    split.wrap(compressed_mod, "eq5_attention", "eq.5 eq5_attention")
    split.wrap(RaggedStore, "append", "cache append")
    split.wrap(RaggedStore, "rebuild", "cache compaction (rebuild)")
    try:
        t0 = time.perf_counter()
        engine.compress([ex.context])
        total = time.perf_counter() - t0
        timer = dict(split.s)
        split.s.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.compress([ex.context])
    finally:
        split.restore()
    rest = total - sum(timer.values())
    print(f"\n--profile: gated prefill (compress) at n={n}, {UNTRAINED_NOTE if not args.checkpoint else args.checkpoint}")
    print(f"{'part':<36} {'s':>8} {'share':>7}")
    for k, v in sorted(timer.items(), key=lambda kv: -kv[1]):
        print(f"{k:<36} {v:>8.3f} {v / total:>7.1%}")
    print(f"{'rest of the model (proj, MLP, ...)':<36} {rest:>8.3f} {rest / total:>7.1%}")
    print(f"{'total compress':<36} {total:>8.3f} {1:>7.1%}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    print("\ntorch.profiler, top ops by self CPU time (kvgate::* rows are the wrapped parts, "
          "inclusive):")
    print(table)
    return {"length": n, "total_s": total, "split_s": {**timer, "rest": rest},
            "profiler_top_ops": table}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base, gated, tok, note = load_models(args)
    print(f"budget {args.budget}, task {args.task}, repeats {args.repeats} (median), "
          f"max_new_tokens {args.max_new_tokens}, torch threads {torch.get_num_threads()}")
    if note:
        print(note)
    print(f"{'length':>6} | {'policy':<15} | {'compress s':>10} | {'answer s':>8} | {'total':>7} | "
          f"{'x full':>6} | {'kept':>5} | hit")
    # the policies as given (names and --policy-opt), not the built objects
    result = {"args": {k: v for k, v in vars(args).items() if k != "built"}, "note": note,
              "rows": measure(args, base, gated, tok)}
    if args.profile and gated is not None:
        result["profile"] = profile_gated_prefill(args, gated, tok)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
