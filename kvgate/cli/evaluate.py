"""``kvgate eval`` (also ``python -m kvgate.eval``): accuracy, retrieval, RULER-style and
LongBench long context and perplexity under KV eviction.

Long context is question-agnostic by default, as the field measures it (kvpress, RULER): the
context is compressed without its question, which is asked after (``needle``, ``ruler``,
``longbench``; ``--query-aware`` puts the question inside the compressed prompt). ``ppl``
already is: the policy sees only each text's first part, and the scored rest comes after
compression. ``--score teacher`` (needle with ``--scoring generate``, ruler, longbench) scores
the gold answers in one forward instead of (or, as ``generate,teacher``, next to) decoding
them; ``--paired POLICY`` adds each row's difference to that policy on the same examples.

Examples:
    kvgate eval mc --model smollm2-135m --tasks rte,copa \\
        --policies full,snapkv,h2o --budgets 0.5 --mode masked --limit 50 --out out/x
    kvgate eval matched --checkpoint runs/sft/export --tasks rte \\
        --policies snapkv,h2o --mode masked --out out/m
    kvgate eval needle --model smollm2-135m --lengths 1024,2048 \\
        --depths 0,50,100 --policies full,snapkv --budgets 0.25 --scoring rank --out out/n
    kvgate eval ppl --model smollm2-135m --policies full,h2o --budgets 0.5 \\
        --docs 50 --max-length 512 --out out/p
    kvgate eval ruler --model smollm2-135m --lengths 1024,2048 --limit 5 \\
        --policies full,snapkv --budgets 0.25,0.5,0.75 --out out/r
    kvgate eval ruler --model smollm2-135m --lengths 4096 --limit 48 --score teacher \\
        --policies full,snapkv,knorm --paired snapkv --out out/rt
    kvgate eval longbench --model smollm2-135m --tasks hotpotqa,trec,lcc --limit 20 \\
        --max-length 7500 --policies full,snapkv --budgets 0.5 --out out/lb
    kvgate eval pattern --checkpoint runs/cpt/export --tasks boolq --samples 3 --out out/x
    kvgate eval calibrate --checkpoint runs/cpt_kvzap/gated --policies local_gate \\
        --evict 0.25,0.5,0.75 --lengths 1024,4096 --out out/cal   # a gate's tau per length
    kvgate eval report --out out/x

Every run appends to ``OUT/results.json`` (resumable: finished keys and examples are skipped)
and rewrites ``OUT/results.md`` and the plots. Runs of the same model may share OUT at once
(say, two budgets side by side): each save merges under a lock, so none drops another's keys.
Progress is one display on stderr for the whole run (every policy x budget x example still to
score; calibrate: every compression): a bar on a terminal, else a line at most every few
seconds, done / total with the time left; ``--quiet`` (or ``--no-progress``) leaves it out.
Budgets are ratios of each context's real length (0.5 keeps half the entries of every KV head)
or integer token counts (> 1).
Policy options: ``--policy-opt snapkv.window=16`` (repeatable; VALUE parsed as JSON when it
can be). ``--policies snapkv,snapkv10=snapkv --policy-opt snapkv10.window=0.1`` runs one
policy under a second label with other options. Bad arguments print one line and exit 2.

A result is reused only by a run with the same model and the same settings that change scores
(--max-length, --dtype, --split, --fewshot-*, --truncate, --docs, --seed, --text-files,
--samples, --distractors, --max-new-tokens, --prefix, --depths, --no-chat, --query-aware,
--source, --score): a run into the same OUT that differs in one of them stops with one line
naming it and both values (kvgate.eval.identity).
A prompt longer than the model's context (max_position_embeddings) stops with one line naming
it and both lengths; --truncate (mc, matched, pattern, ppl) cuts it instead and says what it
dropped, and longbench's --max-length cuts contexts in the middle as LongBench does. Needle
prompts and ppl windows are never cut: their length is the setting.

Each command is one config class and one run function (kvgate.eval.registry): the config's
fields are the command's flags, with their defaults and help (kvgate.eval.options), and it
checks the values; the run function runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.cli.common import run_cli
from kvgate.eval.options import add_flags, plain, summary


def build_parser(prog: str = "python -m kvgate.eval") -> argparse.ArgumentParser:
    """The standalone parser of ``python -m kvgate.eval`` (the command words of ``kvgate
    eval``, so a Ctrl-C reports what ``kvgate eval`` keeps)."""
    p = argparse.ArgumentParser(prog=prog, description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p)
    p.set_defaults(command="eval")
    return p


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``eval`` under ``kvgate``."""
    from kvgate.eval.registry import COMMANDS

    p = sub.add_parser("eval", help="accuracy, retrieval and perplexity under eviction "
                       f"({', '.join(COMMANDS)})", description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p)
    p.set_defaults(run=run_args)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvgate.eval ...``: ``kvgate eval ...`` under its old name."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run_cli(run_args, args)


def add_commands(p: argparse.ArgumentParser) -> None:
    """The eval commands (:data:`kvgate.eval.registry.COMMANDS`) as subparsers of ``p``, each
    with its config's flags. No flag has an argparse default: a flag left out stays out of the
    namespace, and its default comes from the command's config."""
    from kvgate.eval.registry import COMMANDS

    sub = p.add_subparsers(dest="eval_command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        cls = command.config
        sp = sub.add_parser(name, help=summary(cls), description=plain(cls.__doc__),
                            argument_default=argparse.SUPPRESS)
        add_flags(sp, cls)


def config_from_args(args: argparse.Namespace) -> Any:
    """The config of ``args.eval_command`` from the flags given (the rest keep the config's
    defaults); its ``__post_init__`` checks them."""
    from kvgate.eval.registry import COMMANDS

    cls = COMMANDS[args.eval_command].config
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def run_args(args: argparse.Namespace, load: Callable | None = None) -> int:
    """Check the flags, run the command, print the files written and the results table.
    Progress goes to stderr; ``--quiet`` / ``--no-progress`` leave it out, a first load's GGUF
    conversion's included."""
    from kvgate.eval.registry import run_eval
    from kvgate.progress import silenced

    cfg = config_from_args(args)
    with silenced(not getattr(cfg, "progress", True)):
        output = run_eval(cfg, load)
    for path in output.paths:
        print(path)
    print(output.table())
    return 0
