"""``kvgate eval`` (also ``python -m kvgate.eval``): accuracy, retrieval, RULER-style and
LongBench long context and perplexity under KV eviction.

Long context is question-agnostic by default, as the field measures it (kvpress, RULER): the
context is compressed without its question, which is asked after (``needle``, ``ruler``,
``longbench``; ``--query-aware`` puts the question inside the compressed prompt). ``ppl``
already is: the policy sees only each text's first part, and the scored rest comes after
compression.

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
    kvgate eval longbench --model smollm2-135m --tasks hotpotqa,trec,lcc --limit 20 \\
        --max-length 7500 --policies full,snapkv --budgets 0.5 --out out/lb
    kvgate eval pattern --checkpoint runs/cpt/export --tasks boolq --samples 3 --out out/x
    kvgate eval report --out out/x

Every run appends to ``OUT/results.json`` (resumable: finished keys and examples are skipped)
and rewrites ``OUT/results.md`` and the plots. Runs of the same model may share OUT at once
(say, two budgets side by side): each save merges under a lock, so none drops another's keys.
Budgets are ratios of each context's real length (0.5 keeps half the entries of every KV head)
or integer token counts (> 1).
Policy options: ``--policy-opt snapkv.window=16`` (repeatable; VALUE parsed as JSON when it
can be). ``--policies snapkv,snapkv10=snapkv --policy-opt snapkv10.window=0.1`` runs one
policy under a second label with other options. Bad arguments print one line and exit 2.

A result is reused only by a run with the same model and the same settings that change scores
(--max-length, --dtype, --split, --fewshot-*, --truncate, --docs, --seed, --text-files,
--samples, --distractors, --max-new-tokens, --prefix, --depths, --no-chat, --query-aware,
--source): a run into the same OUT that differs in one of them stops with one line naming it
and both values (kvgate.eval.identity).
A prompt longer than the model's context (max_position_embeddings) stops with one line naming
it and both lengths; --truncate (mc, matched, pattern, ppl) cuts it instead and says what it
dropped, and longbench's --max-length cuts contexts in the middle as LongBench does. Needle
prompts and ppl windows are never cut: their length is the setting.

Each command's flags (this module, :mod:`kvgate.eval.flags`) fill one config of
:mod:`kvgate.eval.config` (``MCConfig``, ...), which holds the defaults and checks the values;
:mod:`kvgate.eval.commands` runs it (``run_mc(cfg)``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

# eval command -> its config class in kvgate.eval.config (imported when a command runs)
CONFIGS = {"mc": "MCConfig", "matched": "MatchedConfig", "needle": "NeedleConfig",
           "ppl": "PPLConfig", "ruler": "RulerConfig", "longbench": "LongBenchConfig",
           "pattern": "PatternConfig", "report": "ReportConfig"}


def build_parser(prog: str = "python -m kvgate.eval") -> argparse.ArgumentParser:
    """The standalone parser of ``python -m kvgate.eval``."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(p)
    return p


def add_commands(p: argparse.ArgumentParser) -> None:
    """The eval commands as subparsers of ``p``. No flag has an argparse default: a flag left
    out stays out of the namespace, and its default comes from the command's config."""
    sub = p.add_subparsers(dest="eval_command", metavar="COMMAND", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, argument_default=argparse.SUPPRESS)

    def common(sp: argparse.ArgumentParser, policies: str = "full,snapkv,h2o",
               budgets: bool = True) -> None:
        src = sp.add_mutually_exclusive_group(required=True)
        src.add_argument("--model", help="base model: alias (smollm2-135m), folder, .gguf, hub id")
        src.add_argument("--checkpoint", help="exported gated checkpoint folder")
        sp.add_argument("--out", required=True, help="output folder (results.json, .md, .png)")
        sp.add_argument("--policies",
                        help=f"comma-separated policy names, or 'all' (default {policies})")
        sp.add_argument("--policy-opt", action="append", metavar="NAME.KEY=VALUE")
        if budgets:
            sp.add_argument("--budgets", help="comma-separated budgets: kept ratios or token "
                                              "counts (default 0.5)")
        sp.add_argument("--batch-size", type=int, help="default 8")
        sp.add_argument("--dtype", help="default float32")
        sp.add_argument("--device", help="default cpu")
        sp.add_argument("--no-progress", action="store_true")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")

    def tasks(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tasks", help="comma-separated task names (default rte,copa)")
        sp.add_argument("--limit", type=int, help="first N examples of each task")
        sp.add_argument("--split",
                        help="dataset split (default validation), or sft_test / sft_train: the "
                             "held-out / training part of the deterministic SFT cut "
                             "(kvgate.data.load_sft_split)")
        sp.add_argument("--max-length", type=int,
                        help="cut contexts from the left to fit this many tokens")
        sp.add_argument("--num-fewshot", type=int, metavar="K",
                        help="solved examples before each context (kvgate.data.fewshot); "
                             "results are stored under TASK@Kshot")
        sp.add_argument("--fewshot-split",
                        help="split the demonstrations come from (default: --split; the "
                             "example itself is never drawn)")
        sp.add_argument("--fewshot-seed", type=int)
        sp.add_argument("--mode", choices=["masked", "cache"], help="default masked")
        sp.add_argument("--patterns", type=int,
                        help="eviction-pattern plots of the first N examples for the learned "
                             "gate (default 3; 0 = none)")
        sp.add_argument("--truncate", action="store_true",
                        help="cut a context longer than the model's from the start (a warning "
                             "lists what was dropped) instead of refusing it")

    def corpus(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--docs", type=int,
                        help="corpus documents to use: the last N of the seeded corpus order "
                             "(after any training prefix; default 50)")
        sp.add_argument("--text-files", nargs="*",
                        help="use these .txt/.jsonl files instead of the embedded corpus")
        sp.add_argument("--seed", type=int)

    mc = command("mc", help="multiple choice at fixed budgets")
    common(mc)
    tasks(mc)

    matched = command("matched", help="heuristics at the learned gate's per-example "
                                      "eviction ratio")
    common(matched, policies="snapkv,h2o", budgets=False)
    tasks(matched)
    matched.add_argument("--reference",
                         help="policy whose per-example eviction the others match (default "
                              "attention_gate); LABEL=POLICY takes --policy-opt LABEL.KEY=VALUE "
                              "options")
    matched.add_argument("--reference-budget",
                         help="budget of a heuristic reference policy (default 0.5; "
                              "attention_gate and full ignore it)")
    matched.add_argument("--rounding", choices=("up", "nearest"),
                         help="each example's kept count per head from the reference's eviction: "
                              "rounded up (default; the others evict a little less), or to the "
                              "nearest token (the same eviction on average; budget label "
                              "matched~...)")
    matched.add_argument("--others-on", choices=("checkpoint", "base"),
                         help="what the other policies run on: the checkpoint's model (default), "
                              "or its frozen base with the LoRA adapter off (the training-free "
                              "heuristics as a user would run them; the reference keeps it)")

    needle = command("needle", help="passkey retrieval by context length and depth")
    common(needle, policies="full,snapkv,h2o")
    corpus(needle)
    needle.add_argument("--lengths", help="context lengths in tokens (default 1024,2048)")
    needle.add_argument("--depths", help="needle depths in %% (default 0,25,50,75,100)")
    needle.add_argument("--samples", type=int, help="prompts per (length, depth) (default 5)")
    needle.add_argument("--scoring", choices=["rank", "generate"], help="default rank")
    needle.add_argument("--mode", choices=["masked", "cache"],
                        help="for rank scoring (generate always uses the compressed cache)")
    needle.add_argument("--distractors", type=int, help="default 9")
    needle.add_argument("--max-new-tokens", type=int, help="default 8")
    needle.add_argument("--query-aware", action="store_true",
                        help="compress the whole prompt, question included (the old setting; "
                             "its keys have no -agnostic suffix); by default the question is "
                             "asked after [intro | filler ... needle ...] is compressed")

    ppl = command("ppl", help="perplexity of the second half of texts given their "
                              "compressed first half")
    common(ppl)
    corpus(ppl)
    ppl.add_argument("--max-length", type=int, help="default 512")
    ppl.add_argument("--prefix", type=float, help="share of each text compressed (default 0.5)")
    ppl.add_argument("--mode", choices=["masked", "cache"], help="default masked")
    ppl.add_argument("--context", type=int,
                     help="fixed context length: join the texts into one stream and cut windows "
                          "of context + continuation tokens (overrides --max-length/--prefix)")
    ppl.add_argument("--continuation", type=int,
                     help="scored tokens per window (default: = --context)")
    ppl.add_argument("--windows", type=int, help="windows to score (default: all)")
    ppl.add_argument("--truncate", action="store_true",
                     help="cut a text longer than the model's context to it (a warning says "
                          "how much was dropped) instead of refusing it")

    ruler = command("ruler", help="RULER-style task families (kvgate.eval.ruler), question "
                                  "asked after compression")
    common(ruler)
    ruler.add_argument("--tasks", help="comma-separated RULER tasks, or all (default all 13)")
    ruler.add_argument("--lengths", help="context lengths in tokens (default 1024,2048,4096)")
    ruler.add_argument("--depths", help="needle depths in %% for the niah families "
                                        "(default 0,25,50,75,100; example s at depth s mod n)")
    ruler.add_argument("--limit", type=int, help="examples per (task, length) (default 5)")
    ruler.add_argument("--seed", type=int)
    ruler.add_argument("--source", help="generated (default: offline, exact lengths), hub "
                       "(kvpress's RULER, lengths 4096-131072) or a save_to_disk folder of it")
    ruler.add_argument("--max-new-tokens", type=int,
                       help="cap on RULER's tokens to generate per family (niah 128, vt 30, "
                            "cwe 120, fwe 50, qa 32)")
    ruler.add_argument("--query-aware", action="store_true",
                       help="prefill context and question together under the policy (key mode "
                            "query-aware) instead of asking the question after compression")
    ruler.add_argument("--no-chat", dest="chat", action="store_false",
                       help="plain prompts even when the tokenizer has a chat template")

    longbench = command("longbench", help="LongBench tasks with LongBench's metrics "
                                          "(kvgate.eval.longbench), question asked after "
                                          "compression")
    common(longbench)
    longbench.add_argument("--tasks", help="comma-separated LongBench tasks (hotpotqa, "
                           "qasper-e for LongBench-E, ...) and groups: en (default: the 16 "
                           "English and code tasks), zh, e (the 13 LongBench-E tasks), all")
    longbench.add_argument("--source", help="hub (default: kvpress's Xnhyacinth/LongBench) or a "
                           "save_to_disk folder of it or of THUDM's layout (one sub-folder per "
                           "task, or one dataset)")
    longbench.add_argument("--limit", type=int, help="first N examples of each task (default "
                                                     "all)")
    longbench.add_argument("--max-length", type=int,
                           help="cut a context of more tokens in the middle, keeping its first "
                                "and last N/2 (LongBench's cut; default none: a prompt longer "
                                "than the model's context is refused)")
    longbench.add_argument("--max-new-tokens", type=int,
                           help="cap on LongBench's tokens to generate per task (32 to 512)")
    longbench.add_argument("--query-aware", action="store_true",
                           help="prefill context and question together under the policy (key "
                                "mode query-aware) instead of asking after compression")
    longbench.add_argument("--no-chat", dest="chat", action="store_false",
                           help="plain prompts even when the tokenizer has a chat template "
                                "(trec, triviaqa, samsum, lsht, lcc, repobench-p always are)")

    pattern = command("pattern", help="plot which entries a policy keeps")
    common(pattern, policies="attention_gate")
    tasks(pattern)
    pattern.add_argument("--samples", type=int, help="default 3")

    report = command("report", help="rewrite results.md and the plots from results.json")
    report.add_argument("--out", required=True)
    report.add_argument("--debug", action="store_true")


def config_from_args(args: argparse.Namespace) -> Any:
    """The config of ``args.eval_command`` from the flags given (the rest keep the config's
    defaults); its ``__post_init__`` checks them."""
    from kvgate.eval import config

    cls = getattr(config, CONFIGS[args.eval_command])
    given = vars(args)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in given.items() if k in names}
    if given.get("no_progress"):
        values["progress"] = False
    return cls(**values)


def run_args(args: argparse.Namespace, load: Callable | None = None) -> int:
    """Check the flags, run the command, print the files written and the results table."""
    from kvgate.eval.commands import run_eval

    output = run_eval(config_from_args(args), load)
    for path in output.paths:
        print(path)
    print(output.table())
    return 0
