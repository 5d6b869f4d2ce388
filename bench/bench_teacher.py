"""Teacher scoring against generation on the same RULER examples: cost per example, and how
often greedy-exact agrees with the generated answer's RULER score.

    python bench/bench_teacher.py --length 4096 --examples 6 \
        --tasks niah_single_1,niah_single_2,niah_multikey_1 --policies full,snapkv,tova \
        --budget 0.5 --max-new-tokens 32 --threads 1 [--dtype bfloat16] [--json out.json]

Every example is asked as ``kvgate eval ruler`` asks it (question after compression, one
shared prefill for all policies, ``kvgate.eval.asked.ask_shared``) twice, side by side: once
with ``--score generate`` (greedy decoding, RULER's metric on the text) and once with
``--score teacher`` (the gold answers fed once after the greedy lead-in). Which of the two
runs first alternates per example, so a machine shared with other jobs slows both alike. The
cost ratios are the sum of teacher seconds over the sum of generate seconds, for whole
examples (prefill, compression and answers of every policy) and for the answer phase alone
(what the two scorers do differently: ``Asked.answer_seconds``). Agreement: the share of (example, policy)
pairs whose greedy-exact score equals the generated score, and the pairs that disagree with
both answers shown (the generated text and the teacher's lead-in). Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate
from kvgate.eval.asked import ask_shared
from kvgate.eval.benchmarks.ruler.run import RULER, build_items
from kvgate.eval.runner import record
from kvgate.policies import Budget, get_policy


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--examples", type=int, default=6, help="examples per task")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    ap.add_argument("--policies", default="full,snapkv,tova")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16: fast "
                    "where the CPU has AMX; measure with bench/bench_dtype.py)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.policies = [p for p in args.policies.split(",") if p]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvgate.load_base(args.base, dtype=args.dtype)
    variants = {}
    for name in args.policies:
        pol = get_policy(name)
        variants[name] = (pol, Budget(ratio=1.0) if pol.budget_free else
                          Budget(ratio=args.budget))
    seconds = {"generate": 0.0, "teacher": 0.0}
    answering = {"generate": 0.0, "teacher": 0.0}  # the answer phase alone
    pairs, disagree = [], []
    n = 0
    for task in args.tasks:
        items = build_items(tok, task, args.length, (0, 25, 50, 75, 100), args.examples,
                            max_new_cap=args.max_new_tokens)
        for i, item in enumerate(items):
            got = {}
            for scores in (("generate",), ("teacher",))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                got[scores[0]] = ask_shared(model, tok, item.context, item.question, variants,
                                            list(scores))
                seconds[scores[0]] += time.perf_counter() - t0
                answering[scores[0]] += sum(a.answer_seconds for a in got[scores[0]].values())
            n += 1
            for name in variants:
                gen = record(RULER, item, got["generate"][name])["score"]
                rec = record(RULER, item, got["teacher"][name])
                pairs.append(gen == rec["teacher_score"])
                if gen != rec["teacher_score"]:
                    lead = tok.decode(list(rec["teacher"][0]["lead"]))
                    disagree.append({"uid": item.uid, "policy": name, "generated": gen,
                                     "greedy_exact": rec["teacher_score"],
                                     "output": got["generate"][name].text,
                                     "lead_in": lead, "answers": list(item.answers)})
            print(f"{item.uid}: generate {seconds['generate'] / n:.1f} s / example, teacher "
                  f"{seconds['teacher'] / n:.1f} s / example so far", flush=True)
    out = {"length": args.length, "examples": n, "dtype": args.dtype, "policies": args.policies,
           "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
           "sec_generate": seconds["generate"] / n, "sec_teacher": seconds["teacher"] / n,
           "teacher_over_generate": seconds["teacher"] / seconds["generate"],
           "answer_sec_generate": answering["generate"] / n,
           "answer_sec_teacher": answering["teacher"] / n,
           "answer_teacher_over_generate": answering["teacher"] / answering["generate"],
           "agree_pct": 100.0 * sum(pairs) / len(pairs), "pairs": len(pairs),
           "disagree": disagree}
    print(f"\n{n} examples x {len(variants)} policies at {args.length} tokens: teacher "
          f"{out['sec_teacher']:.1f} s, generate ({args.max_new_tokens} tokens) "
          f"{out['sec_generate']:.1f} s per example: {out['teacher_over_generate']:.2f}x; "
          f"the answer alone {out['answer_sec_teacher']:.1f} s vs "
          f"{out['answer_sec_generate']:.1f} s: {out['answer_teacher_over_generate']:.2f}x; "
          f"greedy-exact agrees on {out['agree_pct']:.1f}% of {len(pairs)} pairs")
    for d in disagree:
        print(f"  {d['uid']} {d['policy']}: generated {d['generated']:.0f}, greedy-exact "
              f"{d['greedy_exact']:.0f}, answers {d['answers']}, output {d['output'][:60]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
