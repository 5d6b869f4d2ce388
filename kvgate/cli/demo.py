"""``kvgate demo``: one long document compressed once by the full cache, the learned gate and
the heuristics at the gate's kept share; the same questions asked after compression; one table
of what each kept, the KV bytes it held and what it answered.

Examples:
    kvgate demo                                           # the main job's gate, the built-in document
    kvgate demo --checkpoint runs/cpt_kvzap/gated
    kvgate demo --checkpoint runs/cpt_kvzap_quick/gated --context-file report.txt \\
        --question "Who signed the report?" --answer "Ada Byron"

The built-in document is about 2,000 tokens of Wikipedia passages that no training corpus
here holds (BoolQ's, an evaluation set), with three invented facts at 15%, 50% and 85% of its
length; each answer is checked for its fact. With ``--context-file`` the questions are
yours, and ``--answer`` (one per ``--question``, optional) gives the facts to check.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvgate.cli.common import run_cli
from kvgate.errors import KVGateError
from kvgate.files import read_user_text

MAIN_JOB_GATE = "runs/cpt_kvzap_quick/gated"  # what `bash scripts/main.sh` trains and exports


class DemoCliError(KVGateError, ValueError):
    """A bad ``kvgate demo`` command line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=MAIN_JOB_GATE,
                   help="gated export (or KVzap folder, or hub id) whose gate is shown "
                        f"(default: the main job's, {MAIN_JOB_GATE})")
    p.add_argument("--base", default=None,
                   help="the base model under --checkpoint when it names none (KVzap)")
    p.add_argument("--context-file", default=None,
                   help="your document (default: the built-in one, with its three questions)")
    p.add_argument("--question", action="append", default=None,
                   help="a question asked after compression (repeatable; with --context-file)")
    p.add_argument("--answer", action="append", default=None,
                   help="the fact each --question asks for, checked in every answer "
                        "(repeatable, in the questions' order)")
    p.add_argument("--tokens", type=int, default=2000,
                   help="length of the built-in document in tokens (default 2000)")
    p.add_argument("--policies", default="full,gate,tova,snapkv",
                   help="comma-separated; 'gate' is the checkpoint's gate, the others keep "
                        "its kept share (default: full,gate,tova,snapkv)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="compress one document with the learned gate and the "
                       "heuristics, answer questions after compression, print one table",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def _questions(args: argparse.Namespace) -> tuple[list[str], list[str | None]]:
    """The questions and their facts, checked before the model loads."""
    from kvgate.demo import FACTS

    if args.context_file is None:
        if args.question or args.answer:
            raise DemoCliError("--question and --answer go with --context-file (the built-in "
                               "document has its own three)")
        return [f.question for f in FACTS], [f.answer for f in FACTS]
    if not read_user_text(args.context_file, "--context-file").strip():
        raise DemoCliError(f"--context-file {args.context_file}: empty")
    if not args.question or any(not q.strip() for q in args.question):
        raise DemoCliError("--context-file needs at least one non-empty --question")
    gold = list(args.answer or [])
    if gold and len(gold) != len(args.question):
        raise DemoCliError(f"--answer given {len(gold)} times for {len(args.question)} "
                           "--question: give one per question, or none")
    return list(args.question), gold or [None] * len(args.question)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvgate.checkpoint import gate_kind, load_gated
    from kvgate.demo import demo_document, demo_table, run_demo
    from kvgate.policies import get_policy
    from kvgate.policies.registry import gate_policy_name

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise DemoCliError("--policies names no policy")
    for name in policies:
        if name != "gate":
            get_policy(name)  # an unknown name fails here, before the model loads
    if args.max_new_tokens < 1:
        raise DemoCliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    questions, gold = _questions(args)
    if args.checkpoint == MAIN_JOB_GATE and not Path(MAIN_JOB_GATE).exists():
        raise DemoCliError(f"{MAIN_JOB_GATE} does not exist yet: run `bash scripts/main.sh` "
                           "(or `kvgate data oracle --config cpt_kvzap_quick` then `kvgate "
                           "train --config cpt_kvzap_quick`), or pass --checkpoint")
    gate = gate_policy_name(gate_kind(args.checkpoint))
    model, tokenizer, _ = load_gated(args.checkpoint, base=args.base, dtype=args.dtype)
    if args.context_file is None:
        context = demo_document(tokenizer, args.tokens)
    else:
        context = read_user_text(args.context_file, "--context-file")
    say = None if args.json else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    if say is not None:
        n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        say(f"document: {n:,} tokens; {len(questions)} questions, asked after compression")
    rows = run_demo(model, tokenizer, context, questions, gold, gate_policy=gate,
                    policies=policies, max_new_tokens=args.max_new_tokens, say=say)
    if args.json:
        print(json.dumps({"questions": questions, "facts": gold,
                          "rows": [r.to_dict() for r in rows]}, indent=2))
        return 0
    encoding = (getattr(sys.stdout, "encoding", None) or "ascii").lower()
    marks = ("✓", "✗") if "utf" in encoding else ("yes", "no")
    print(demo_table(rows, questions, gold, marks=marks))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "kvgate demo") -> int:
    """``kvgate demo ...`` on its own (for scripts and tests)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(run, p.parse_args(None if argv is None else list(argv)))
