"""``python -m kvgate.eval``: accuracy, retrieval and perplexity under KV eviction.

Examples:
    python -m kvgate.eval mc --model smollm2-135m --tasks rte,copa \\
        --policies full,snapkv,h2o --budgets 0.5 --mode masked --limit 50 --out results/x
    python -m kvgate.eval matched --checkpoint runs/sft/export --tasks rte \\
        --policies snapkv,h2o --mode masked --out results/m
    python -m kvgate.eval needle --model smollm2-135m --lengths 1024,2048 \\
        --depths 0,50,100 --policies full,snapkv --budgets 0.25 --scoring rank --out results/n
    python -m kvgate.eval ppl --model smollm2-135m --policies full,h2o --budgets 0.5 \\
        --docs 50 --max-length 512 --out results/p
    python -m kvgate.eval pattern --checkpoint runs/cpt/export --tasks boolq --samples 3 \\
        --out results/x
    python -m kvgate.eval report --out results/x

Every run appends to ``OUT/results.json`` (resumable: finished keys and examples are skipped)
and rewrites ``OUT/results.md`` and the plots. Runs of the same model may share OUT at once
(say, two budgets side by side): each save merges under a lock, so none drops another's keys.
Budgets are ratios of each context's real length (0.5 keeps half the entries of every KV head)
or integer token counts (> 1).
Policy options: ``--policy-opt snapkv.window=16`` (repeatable; VALUE parsed as JSON when it
can be). ``--policies snapkv,snapkv10=snapkv --policy-opt snapkv10.window=0.1`` runs one
policy under a second label with other options. Bad arguments print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _csv(raw: str) -> list[str]:
    return [x.strip() for x in raw.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvgate.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, policies: str = "full,snapkv,h2o",
               budgets: bool = True) -> None:
        src = sp.add_mutually_exclusive_group(required=True)
        src.add_argument("--model", help="base model: alias (smollm2-135m), folder, .gguf, hub id")
        src.add_argument("--checkpoint", help="exported gated checkpoint folder")
        sp.add_argument("--out", required=True, help="output folder (results.json, .md, .png)")
        sp.add_argument("--policies", default=policies,
                        help=f"comma-separated policy names, or 'all' (default {policies})")
        sp.add_argument("--policy-opt", action="append", default=[], metavar="NAME.KEY=VALUE")
        if budgets:
            sp.add_argument("--budgets", default="0.5",
                            help="comma-separated budgets: kept ratios or token counts")
        sp.add_argument("--batch-size", type=int, default=8)
        sp.add_argument("--dtype", default="float32")
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--no-progress", action="store_true")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")

    def tasks(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tasks", default="rte,copa", help="comma-separated task names")
        sp.add_argument("--limit", type=int, default=None, help="first N examples of each task")
        sp.add_argument("--split", default="validation",
                        help="dataset split, or sft_test / sft_train: the held-out / training "
                             "part of the deterministic SFT cut (kvgate.data.load_sft_split)")
        sp.add_argument("--max-length", type=int, default=None,
                        help="cut contexts from the left to fit this many tokens")
        sp.add_argument("--num-fewshot", type=int, default=0, metavar="K",
                        help="solved examples before each context (kvgate.data.fewshot); "
                             "results are stored under TASK@Kshot")
        sp.add_argument("--fewshot-split", default=None,
                        help="split the demonstrations come from (default: --split; the "
                             "example itself is never drawn)")
        sp.add_argument("--fewshot-seed", type=int, default=0)
        sp.add_argument("--mode", default="masked", choices=["masked", "cache"])
        sp.add_argument("--patterns", type=int, default=3,
                        help="eviction-pattern plots of the first N examples for the learned "
                             "gate (0 = none)")

    def corpus(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--docs", type=int, default=50,
                        help="corpus documents to use: the last N of the seeded corpus order "
                             "(after any training prefix)")
        sp.add_argument("--text-files", nargs="*", default=None,
                        help="use these .txt/.jsonl files instead of the embedded corpus")
        sp.add_argument("--seed", type=int, default=0)

    mc = sub.add_parser("mc", help="multiple choice at fixed budgets")
    common(mc)
    tasks(mc)

    matched = sub.add_parser("matched", help="heuristics at the learned gate's per-example "
                                             "eviction ratio")
    common(matched, policies="snapkv,h2o", budgets=False)
    tasks(matched)
    matched.add_argument("--reference", default="attention_gate",
                         help="policy whose per-example eviction the others match; "
                              "LABEL=POLICY takes --policy-opt LABEL.KEY=VALUE options")
    matched.add_argument("--reference-budget", default="0.5",
                         help="budget of a heuristic reference policy (attention_gate and "
                              "full ignore it)")
    matched.add_argument("--rounding", choices=("up", "nearest"), default="up",
                         help="each example's kept count per head from the reference's eviction: "
                              "rounded up (the others evict a little less), or to the nearest "
                              "token (the same eviction on average; budget label matched~...)")
    matched.add_argument("--others-on", choices=("checkpoint", "base"), default="checkpoint",
                         help="what the other policies run on: the checkpoint's model, or its "
                              "frozen base with the LoRA adapter off (the training-free "
                              "heuristics as a user would run them; the reference keeps it)")

    needle = sub.add_parser("needle", help="passkey retrieval by context length and depth")
    common(needle, policies="full,snapkv,h2o")
    corpus(needle)
    needle.add_argument("--lengths", default="1024,2048", help="context lengths in tokens")
    needle.add_argument("--depths", default="0,25,50,75,100", help="needle depths in %%")
    needle.add_argument("--samples", type=int, default=5, help="prompts per (length, depth)")
    needle.add_argument("--scoring", default="rank", choices=["rank", "generate"])
    needle.add_argument("--mode", default="masked", choices=["masked", "cache"],
                        help="for rank scoring (generate always uses the compressed cache)")
    needle.add_argument("--distractors", type=int, default=9)
    needle.add_argument("--max-new-tokens", type=int, default=8)

    ppl = sub.add_parser("ppl", help="perplexity of the second half of texts given their "
                                     "compressed first half")
    common(ppl)
    corpus(ppl)
    ppl.add_argument("--max-length", type=int, default=512)
    ppl.add_argument("--prefix", type=float, default=0.5, help="share of each text compressed")
    ppl.add_argument("--mode", default="masked", choices=["masked", "cache"])
    ppl.add_argument("--context", type=int, default=None,
                     help="fixed context length: join the texts into one stream and cut windows "
                          "of context + continuation tokens (overrides --max-length/--prefix)")
    ppl.add_argument("--continuation", type=int, default=None,
                     help="scored tokens per window (default: = --context)")
    ppl.add_argument("--windows", type=int, default=None, help="windows to score (default: all)")

    pattern = sub.add_parser("pattern", help="plot which entries a policy keeps")
    common(pattern, policies="attention_gate")
    tasks(pattern)
    pattern.add_argument("--samples", type=int, default=3)

    report = sub.add_parser("report", help="rewrite results.md and the plots from results.json")
    report.add_argument("--out", required=True)
    report.add_argument("--debug", action="store_true")
    return p


# ---------------------------------------------------------------------------------------------
# argument checks (before the model loads, so mistakes fail in a second)


def parse_budgets(raw: str) -> list[Any]:
    from kvgate.eval.masked import EvalError
    from kvgate.policies.base import Budget

    values = _csv(raw)
    if not values:
        raise EvalError("--budgets: give at least one budget")
    return [Budget.parse(v) for v in values]


def parse_policies(raw: str, options: list[str]) -> dict[str, Any]:
    from kvgate.eval.masked import EvalError
    from kvgate.policies import get_policy, list_policies

    items = list_policies() if raw.strip() == "all" else _csv(raw)
    if not items:
        raise EvalError("--policies: give at least one policy")
    # LABEL=POLICY runs one policy twice under different labels (e.g. two window settings)
    kinds = {}
    for item in items:
        label, sep, kind = item.partition("=")
        label, kind = label.strip(), (kind.strip() if sep else label.strip())
        if not label or not kind or label in kinds:
            raise EvalError(f"--policies: {item!r} is empty or repeats a label")
        kinds[label] = kind
    names = list(kinds)
    per: dict[str, dict[str, Any]] = {n: {} for n in names}
    for item in options:
        target, sep, raw_value = item.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not key:
            raise EvalError(f"--policy-opt {item!r}: expected NAME.KEY=VALUE")
        if name not in per:
            raise EvalError(f"--policy-opt {item!r}: policy {name!r} is not in --policies")
        try:
            per[name][key] = json.loads(raw_value)
        except json.JSONDecodeError:
            per[name][key] = raw_value
    return {n: get_policy(kinds[n], **per[n]) for n in names}


def parse_tasks(raw: str) -> list[str]:
    from kvgate.data.tasks import TASKS
    from kvgate.eval.masked import EvalError

    names = _csv(raw)
    if not names:
        raise EvalError("--tasks: give at least one task")
    for t in names:
        if t not in TASKS:
            raise EvalError(f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
    return names


def parse_numbers(raw: str, what: str, kind: type) -> list[Any]:
    from kvgate.eval.masked import EvalError

    try:
        values = [kind(v) for v in _csv(raw)]
    except ValueError:
        raise EvalError(f"--{what}: {raw!r} is not a comma-separated list of numbers") from None
    if not values:
        raise EvalError(f"--{what}: give at least one value")
    return values


def check_positive(value: int | None, what: str) -> None:
    from kvgate.eval.masked import EvalError

    if value is not None and value < 1:
        raise EvalError(f"--{what} must be >= 1, got {value}")


# ---------------------------------------------------------------------------------------------
# running


def load_model(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, store meta)."""
    if args.checkpoint is not None:
        from kvgate.checkpoint import load_gated, read_meta

        on_base = getattr(args, "others_on", "checkpoint") == "base"
        if on_base and not read_meta(args.checkpoint, verify=False).get("lora"):
            from kvgate.eval.masked import EvalError

            raise EvalError(f"--others-on base: {args.checkpoint} has no LoRA adapter, so its "
                            "model is the base already; leave the option out")
        # the adapter must stay a separate peft module for the others to switch it off
        model, tokenizer, meta = load_gated(args.checkpoint, dtype=args.dtype, device=args.device,
                                            merge_lora=not on_base)
        base = meta.get("base", {}).get("id")
        store_meta = {"model": base, "checkpoint": str(Path(args.checkpoint).resolve())}
        if on_base:  # kept apart from folders whose others ran with the adapter
            store_meta["others_on"] = "base"
        return model, tokenizer, store_meta
    from kvgate.models import load_base

    model, tokenizer = load_base(args.model, dtype=args.dtype, device=args.device)
    return model, tokenizer, {"model": args.model, "checkpoint": None}


def check_gate(model: Any, policies: dict[str, Any]) -> None:
    from kvgate.eval.masked import EvalError
    from kvgate.gate import gate_modules

    if any(p.name == "attention_gate" for p in policies.values()) and not gate_modules(model):
        raise EvalError("policy attention_gate needs a gated model: pass --checkpoint DIR")


def load_split(task: str, split: str, limit: int | None = None) -> list[Any]:
    from kvgate.data import load_sft_split, load_task

    if split in ("sft_test", "sft_train"):
        return load_sft_split(task, split.removeprefix("sft_"))[:limit]
    return load_task(task, split=split, limit=limit)


def load_tasks(args: argparse.Namespace, names: list[str]) -> dict[str, list[Any]]:
    """Examples of each task, with ``--num-fewshot`` demonstrations when asked, keyed by the
    label their results are stored under."""
    from kvgate.data.fewshot import add_fewshot, fewshot_label

    k = getattr(args, "num_fewshot", 0)
    out = {}
    for task in names:
        examples = load_split(task, args.split, args.limit)
        if k:
            pool = load_split(task, args.fewshot_split or args.split)
            examples = add_fewshot(examples, pool, k, args.fewshot_seed)
        out[fewshot_label(task, k)] = examples
    return out


def load_texts(args: argparse.Namespace) -> list[str]:
    from kvgate.data import load_corpus, load_text_files

    if args.text_files:
        return load_text_files(args.text_files)
    docs = load_corpus(None, seed=args.seed)
    return docs[-args.docs:]


def write_patterns(model: Any, tokenizer: Any, tasks: dict[str, list[Any]],
                   policies: dict[str, Any], budget: Any, samples: int, out: Path) -> list[Path]:
    """Eviction-pattern plots of the first ``samples`` examples of the first task."""
    from kvgate.eval.masked import masked_scores, pad_id
    from kvgate.eval.multiple_choice import mc_item
    from kvgate.eval.report import plot_eviction_pattern

    task = next(iter(tasks))
    examples = tasks[task][:samples]
    paths = []
    for name, policy in policies.items():
        for i, ex in enumerate(examples):
            item = mc_item(ex, tokenizer)
            _, keeps = masked_scores(model, [item], policy, [budget], pad_id(tokenizer),
                                     record=True)
            tokens = None
            if hasattr(tokenizer, "convert_ids_to_tokens"):
                tokens = tokenizer.convert_ids_to_tokens(list(item.context))
            path = out / f"pattern_{name}_{task}_{i}.png"
            paths.append(plot_eviction_pattern(keeps[0], path, f"{name} on {ex.uid}:", tokens))
    return paths


def run(args: argparse.Namespace) -> int:
    from kvgate.eval import multiple_choice as mc
    from kvgate.eval import needle as nd
    from kvgate.eval.report import ResultStore, markdown_table, write_outputs
    from kvgate.policies.base import Budget

    out = Path(args.out)
    if args.command == "report":
        results = out / "results.json"
        from kvgate.data.cache import read_json
        from kvgate.eval.masked import EvalError

        data = read_json(results)
        if data is None:
            raise EvalError(f"{results}: no readable results")
        store = ResultStore(out, data.get("meta", {}))
        for path in write_outputs(store):
            print(path)
        print(markdown_table(store.complete_results()))
        return 0

    check_positive(args.batch_size, "batch-size")
    policy_opts = list(args.policy_opt)
    if args.command == "matched":
        # the reference takes LABEL=POLICY and its own --policy-opt LABEL.KEY=VALUE, so a gate
        # at an inference threshold can set the budgets: --reference ag=attention_gate
        # --policy-opt ag.tau=0.7
        ref_label = args.reference.partition("=")[0].strip()
        ref_opts = [o for o in policy_opts if o.partition(".")[0] == ref_label]
        policy_opts = [o for o in policy_opts if o not in ref_opts]
        reference = parse_policies(args.reference, ref_opts)[ref_label]
        ref_budget = Budget.parse(args.reference_budget)
    policies = parse_policies(args.policies, policy_opts)
    budgets = parse_budgets(args.budgets) if hasattr(args, "budgets") else []
    names = parse_tasks(args.tasks) if hasattr(args, "tasks") else []
    for attr in ("limit", "max_length", "samples", "docs", "max_new_tokens"):
        check_positive(getattr(args, attr, None), attr.replace("_", "-"))
    if getattr(args, "num_fewshot", 0) < 0:
        from kvgate.eval.masked import EvalError

        raise EvalError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    progress = not args.no_progress
    if args.command == "needle":
        lengths = parse_numbers(args.lengths, "lengths", int)
        depths = parse_numbers(args.depths, "depths", float)

    model, tokenizer, meta = load_model(args)
    if args.policies.strip() == "all":  # 'all' means every policy this model can run
        from kvgate.gate import gate_modules

        if not gate_modules(model):
            policies = {n: p for n, p in policies.items() if p.name != "attention_gate"}
    check_gate(model, policies if args.command != "matched" else {"ref": reference})
    store = ResultStore(out, meta)
    tasks = load_tasks(args, names) if names else {}
    extra_paths = []
    if args.command == "mc":
        mc.evaluate_mc(model, tokenizer, tasks, policies, budgets, args.mode, store,
                       args.batch_size, args.max_length, progress)
        # thresholded gates (a ranked one has budgets: the `pattern` command draws it)
        gated = {n: p for n, p in policies.items() if p.name == "attention_gate" and p.budget_free}
        if gated and args.patterns:
            extra_paths = write_patterns(model, tokenizer, tasks, gated, Budget(ratio=1.0),
                                         args.patterns, out)
    elif args.command == "matched":
        others = model.disable_adapter if args.others_on == "base" else None
        mc.evaluate_matched(model, tokenizer, tasks, policies, reference, args.mode, store,
                            ref_label, ref_budget, args.batch_size, args.max_length,
                            progress, others=others, rounding=args.rounding)
        if args.patterns and reference.name == "attention_gate":
            extra_paths = write_patterns(model, tokenizer, tasks, {ref_label: reference},
                                         Budget(ratio=1.0) if reference.budget_free else ref_budget,
                                         args.patterns, out)
    elif args.command == "needle":
        nd.evaluate_needle(model, tokenizer, load_texts(args), lengths, depths, policies,
                           budgets, store, args.scoring, args.mode, args.samples,
                           args.distractors, args.max_new_tokens, args.batch_size, args.seed,
                           progress)
    elif args.command == "ppl":
        nd.evaluate_ppl(model, tokenizer, load_texts(args), policies, budgets, store, args.mode,
                        args.max_length, args.prefix, batch_size=args.batch_size,
                        progress=progress, context=args.context,
                        continuation=args.continuation, windows=args.windows)
    elif args.command == "pattern":
        extra_paths = write_patterns(model, tokenizer, tasks, policies, budgets[0],
                                     args.samples, out)
    for path in [*write_outputs(store), *extra_paths]:
        print(path)
    print(markdown_table(store.complete_results()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvgate.cli import run_cli
    from kvgate.eval.masked import EvalError

    return run_cli(run, build_parser().parse_args(argv), extra=(EvalError,))


if __name__ == "__main__":
    sys.exit(main())
