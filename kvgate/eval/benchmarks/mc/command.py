"""``kvgate eval mc``, ``matched`` and ``pattern``: the multiple-choice commands (their scoring
is :mod:`kvgate.eval.multiple_choice`) and their registry entries."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.eval.benchmarks.mc.config import MatchedConfig, MCConfig, PatternConfig, TaskConfig
from kvgate.eval.benchmarks.mc.report import REPORT, plot_eviction_pattern
from kvgate.eval.command import Command

if TYPE_CHECKING:  # the registry reads this module to build the command line: no torch yet
    from kvgate.eval.commands import EvalOutput, Loader
    from kvgate.policies.base import Budget, Policy


def load_split(task: str, split: str, limit: int | None = None) -> list[Any]:
    from kvgate.data import load_sft_split, load_task

    if split in ("sft_test", "sft_train"):
        return load_sft_split(task, split.removeprefix("sft_"))[:limit]
    return load_task(task, split=split, limit=limit)


def load_tasks(cfg: TaskConfig) -> dict[str, list[Any]]:
    """Examples of each task, with ``num_fewshot`` demonstrations when asked, keyed by the
    label their results are stored under."""
    from kvgate.data.fewshot import add_fewshot, fewshot_label

    out = {}
    for task in cfg.tasks:
        examples = load_split(task, cfg.split, cfg.limit)
        if cfg.num_fewshot:
            pool = load_split(task, cfg.fewshot_split or cfg.split)
            examples = add_fewshot(examples, pool, cfg.num_fewshot, cfg.fewshot_seed)
        out[fewshot_label(task, cfg.num_fewshot)] = examples
    return out


def write_patterns(model: Any, tokenizer: Any, tasks: dict[str, list[Any]],
                   policies: dict[str, Policy], budget: Budget, samples: int,
                   out: Path, cfg: TaskConfig | None = None) -> list[Path]:
    """Eviction-pattern plots of the first ``samples`` examples of the first task (cut as
    ``cfg``'s ``max_length`` and ``truncate`` say)."""
    from kvgate.eval.masked import masked_scores
    from kvgate.eval.multiple_choice import tokenize_tasks
    from kvgate.models.limits import context_limit
    from kvgate.models.load import pad_id

    task = next(iter(tasks))
    examples = {task: tasks[task][:samples]}
    items = tokenize_tasks(examples, tokenizer, getattr(cfg, "max_length", None),
                           context_limit(model.config), getattr(cfg, "truncate", False))[task]
    paths = []
    for name, policy in policies.items():
        for i, (ex, item) in enumerate(zip(examples[task], items)):
            _, keeps = masked_scores(model, [item], policy, [budget], pad_id(tokenizer),
                                     record=True)
            tokens = None
            if hasattr(tokenizer, "convert_ids_to_tokens"):
                tokens = tokenizer.convert_ids_to_tokens(list(item.context))
            path = out / f"pattern_{name}_{task}_{i}.png"
            paths.append(plot_eviction_pattern(keeps[0], path, f"{name} on {ex.uid}:", tokens))
    return paths


def run_mc(cfg: MCConfig, load: Loader | None = None) -> EvalOutput:
    """Every (task, policy, budget) at fixed budgets; eviction patterns of a thresholded gate."""
    from kvgate.eval.commands import finish, kept_on_interrupt, loaded, needs_gate
    from kvgate.eval.multiple_choice import evaluate_mc
    from kvgate.eval.qa_options import kv_storage
    from kvgate.policies.base import Budget

    model, tokenizer, policies, store = loaded(cfg, load, cfg.build_policies())
    tasks = load_tasks(cfg)
    with kept_on_interrupt(store):
        evaluate_mc(model, tokenizer, tasks, policies, cfg.budgets, cfg.mode, store,
                    batch_size=cfg.batch_size, max_length=cfg.max_length,
                    progress=cfg.progress, truncate=cfg.truncate, kv=kv_storage(cfg))
    # thresholded gates (a ranked one has budgets: the `pattern` command draws it)
    gated = {n: p for n, p in policies.items() if needs_gate(p) and p.budget_free}
    extra = []
    if gated and cfg.patterns:
        extra = write_patterns(model, tokenizer, tasks, gated, Budget(ratio=1.0), cfg.patterns,
                               Path(cfg.out), cfg)
    return finish(store, extra)


def run_matched(cfg: MatchedConfig, load: Loader | None = None) -> EvalOutput:
    """The reference policy, then the others at its per-example eviction."""
    from kvgate.eval.commands import finish, kept_on_interrupt, loaded, needs_gate
    from kvgate.eval.multiple_choice import evaluate_matched
    from kvgate.eval.qa_options import kv_storage
    from kvgate.policies.base import Budget

    model, tokenizer, policies, store = loaded(cfg, load, cfg.build_policies())
    reference, ref_label, ref_budget = cfg.build_reference(), cfg.reference_label, \
        cfg.reference_budget
    tasks = load_tasks(cfg)
    others = model.disable_adapter if cfg.others_on == "base" else None
    with kept_on_interrupt(store):
        evaluate_matched(model, tokenizer, tasks, policies, reference, cfg.mode, store,
                         reference_name=ref_label, reference_budget=ref_budget,
                         batch_size=cfg.batch_size, max_length=cfg.max_length,
                         progress=cfg.progress, others=others, rounding=cfg.rounding,
                         truncate=cfg.truncate, kv=kv_storage(cfg))
    extra = []
    if cfg.patterns and needs_gate(reference):
        extra = write_patterns(model, tokenizer, tasks, {ref_label: reference},
                               Budget(ratio=1.0) if reference.budget_free else ref_budget,
                               cfg.patterns, Path(cfg.out), cfg)
    return finish(store, extra)


def run_pattern(cfg: PatternConfig, load: Loader | None = None) -> EvalOutput:
    """Eviction-pattern plots of each policy at the first budget."""
    from kvgate.eval.commands import finish, loaded

    model, tokenizer, policies, store = loaded(cfg, load, cfg.build_policies())
    paths = write_patterns(model, tokenizer, load_tasks(cfg), policies, cfg.budgets[0],
                           cfg.samples, Path(cfg.out), cfg)
    return finish(store, paths)


MC = Command(MCConfig, run_mc, REPORT)
MATCHED = Command(MatchedConfig, run_matched, REPORT)
PATTERN = Command(PatternConfig, run_pattern)
