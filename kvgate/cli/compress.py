"""``kvgate infer --context-file F --question Q ...``: compress a document once, then answer
(its options, their checks and its printout; the work is ``kvgate.inference.compress``).

Building the command line imports no torch; ``run`` loads the rest when a command runs.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvgate.errors import KVGateError
from kvgate.files import read_user_text


class CompressCliError(KVGateError, ValueError):
    """A bad compress-once option (exit 2 with one line, like every KVGateError)."""


def add_cli_arguments(parser: Any, prompt_group: Any) -> None:
    """``kvgate infer``'s compress-once options; ``--context-file`` joins ``prompt_group`` (the
    mutually exclusive ``--prompt`` / ``--prompt-file`` group)."""
    prompt_group.add_argument("--context-file",
                              help="a document to compress once (no question inside); "
                                   "then answer each --question over it")
    parser.add_argument("--question", action="append", default=None,
                        help="a question asked after compression (repeatable; needs "
                             "--context-file)")
    parser.add_argument("--answer-prefix", default=None,
                        help="text the answer starts with (after the question)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="--chat / --no-chat: wrap context and question in the chat "
                             "template when the tokenizer has one (default: on)")


def check_cli_arguments(args: Any) -> None:
    """Fast checks before the model loads."""
    context_file = getattr(args, "context_file", None)
    if context_file is None:
        if getattr(args, "question", None) or getattr(args, "answer_prefix", None):
            raise CompressCliError("--question and --answer-prefix need --context-file")
        return
    if getattr(args, "sample", False):
        raise CompressCliError("--context-file answers greedily; drop --sample")
    if not read_user_text(context_file, "--context-file").strip():
        raise CompressCliError(f"--context-file {context_file}: empty")
    if not args.question or any(not q.strip() for q in args.question):
        raise CompressCliError("--context-file needs at least one non-empty --question")


def run(engine: Any, args: Any) -> int:
    """Check the options, then compress the context file once and answer every question."""
    check_cli_arguments(args)
    return _run(engine, args)


def _run(engine: Any, args: Any) -> int:
    """Compress the context file once, answer every ``--question``, print answers and stats."""
    from kvgate.inference.compress import (
        answer,
        budget_text,
        bytes_held_text,
        compress,
        question_room,
        two_columns,
    )

    context = read_user_text(args.context_file, "--context-file")
    room = question_room(engine, args.question, args.max_new_tokens, args.answer_prefix, args.chat)
    compressed = compress(engine, context, chat=args.chat, reserve=room)
    t0 = time.perf_counter()
    answers = answer(engine, compressed, args.question, args.max_new_tokens, args.answer_prefix)
    answer_ms = 1000.0 * (time.perf_counter() - t0)
    stats = {"policy": engine.policy.name, "budget": budget_text(engine.policy, engine.budget),
             "chat": compressed.chat, "context_tokens": compressed.lengths[0],
             "kept_fraction": compressed.kept_fraction,
             "kept_fraction_per_layer": compressed.kept_fraction_per_layer,
             "bytes_held": compressed.bytes_held, "bytes_full": compressed.bytes_full,
             "kv": engine.kv.describe(), "compress_ms": compressed.compress_ms,
             "answer_ms": answer_ms}
    if args.json:
        print(json.dumps({"questions": args.question, "answers": answers, "stats": stats},
                         indent=2))
        return 0
    for question, text in zip(args.question, answers):
        print(f"Q: {question}\nA: {text}\n")
    rows = [("policy", f"{stats['policy']} ({stats['budget']})"),
            ("context tokens", (f"{stats['context_tokens']:,} (chat template: "
                               f"{'yes' if compressed.chat else 'no'})")),
            ("kept (context)", f"{100 * stats['kept_fraction']:.1f}%"),
            ("KV bytes held", bytes_held_text(stats["bytes_held"], stats["bytes_full"])),
            ("KV storage", stats["kv"]),
            ("compress", f"{stats['compress_ms']:.1f} ms"),
            ("answers", f"{answer_ms:.1f} ms for {len(answers)}")]
    print(two_columns(rows))
    return 0
