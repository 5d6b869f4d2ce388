"""``kvgate infer --context-file F --question Q ...``: compress a document once, then answer.

Kept apart from ``kvgate.inference.compress`` so that building the command line imports no
torch; ``run`` loads the rest when a command actually runs.
"""

from __future__ import annotations

import argparse
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
    from kvgate.inference.compress import run_cli

    return run_cli(engine, args)
