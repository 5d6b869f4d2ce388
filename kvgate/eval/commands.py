"""The evaluation commands as plain functions of their configs (:mod:`kvgate.eval.config`).

``run_mc(MCConfig(...))`` does what ``kvgate eval mc ...`` does: load the model, score, append
to ``OUT/results.json`` (resumable) and rewrite ``OUT/results.md`` and the plots. Each returns
an :class:`EvalOutput` (the store and the files written); the command line prints both.
``load`` replaces the model loader (a model already in memory: ``load=lambda cfg: (model,
tokenizer, {"model": "mine", "checkpoint": None})``).

A stored result is reused only by a run with the same model (``meta``: model, checkpoint,
weights digest) and the same score-changing settings (``cfg.settings()``); a run that differs
is refused in one line (:mod:`kvgate.eval.identity`). Every prompt must fit the model's context
(``max_position_embeddings``): a longer one is refused in one line naming it and both lengths,
or cut with ``truncate`` (tasks, per-text perplexity), which says what it dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.eval.config import (
    EvalConfig,
    MatchedConfig,
    MCConfig,
    PatternConfig,
    ReportConfig,
    TaskConfig,
    parse_policies,
)
from kvgate.eval.config_long import (
    CorpusConfig,
    LongBenchConfig,
    NeedleConfig,
    PPLConfig,
    RulerConfig,
)
from kvgate.eval.errors import EvalError
from kvgate.eval.report import ResultStore, markdown_table, write_outputs
from kvgate.policies.base import Budget, Policy

__all__ = ["EvalOutput", "load_model", "parse_policies", "run_longbench",
           "run_matched", "run_mc", "run_needle", "run_pattern", "run_ppl", "run_report",
           "run_ruler", "run_scored"]

Loaded = tuple[Any, Any, dict[str, Any]]
Loader = Callable[[EvalConfig], Loaded]


@dataclass
class EvalOutput:
    store: ResultStore
    paths: list[Path]  # results.md, plots, eviction patterns

    def table(self) -> str:
        return markdown_table(self.store.complete_results())


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def load_model(cfg: EvalConfig) -> Loaded:
    """(model, tokenizer, store meta) of ``cfg.model`` or ``cfg.checkpoint``; the meta's
    ``weights`` is a digest of what was loaded (the checkpoint's file inventory, a local
    model folder's files), so a folder's results never outlive a re-export."""
    if cfg.checkpoint is not None:
        from kvgate.checkpoint import load_gated, read_meta

        on_base = getattr(cfg, "others_on", "checkpoint") == "base"
        if on_base and not read_meta(cfg.checkpoint, verify=False).get("lora"):
            raise EvalError(f"--others-on base: {cfg.checkpoint} has no LoRA adapter, so its "
                            "model is the base already; leave the option out")
        # the adapter must stay a separate peft module for the others to switch it off
        model, tokenizer, meta = load_gated(cfg.checkpoint, base=cfg.base, dtype=cfg.dtype,
                                            device=cfg.device, merge_lora=not on_base)
        base = meta.get("base", {}).get("id") or cfg.base
        where = Path(cfg.checkpoint)  # a hub id stays as it is spelled
        store_meta = {"model": base,
                      "checkpoint": str(where.resolve()) if where.exists() else cfg.checkpoint,
                      "weights": _digest(meta.get("files", {}))}
        if on_base:  # kept apart from folders whose others ran with the adapter
            store_meta["others_on"] = "base"
        return model, tokenizer, store_meta
    from kvgate.models import load_base
    from kvgate.models.load import weights_fingerprint

    model, tokenizer = load_base(cfg.model, dtype=cfg.dtype, device=cfg.device)
    store_meta = {"model": cfg.model, "checkpoint": None}
    weights = weights_fingerprint(cfg.model)
    if weights is not None:
        store_meta["weights"] = weights
    return model, tokenizer, store_meta


def needs_gate(policy: Policy) -> bool:
    """A learned-gate policy (``attention_gate``, the hybrids built on it, ``local_gate``): it
    runs only on a gated model."""
    from kvgate.policies.attention_gate import AttentionGatePolicy
    from kvgate.policies.local_gate import LocalGatePolicy

    return isinstance(policy, (AttentionGatePolicy, LocalGatePolicy))


def gate_refusal(policy: Policy, gates: list[Any]) -> str | None:
    """Why ``policy`` cannot run on a model carrying ``gates`` (its gate modules), or None."""
    from kvgate.policies.local_gate import LocalGatePolicy

    if not needs_gate(policy):
        return None
    if not gates:
        return f"policy {policy.name} needs a gated model: pass --checkpoint DIR"
    if isinstance(policy, LocalGatePolicy) and not all(g.local for g in gates):
        return (f"policy {policy.name} needs a local gate kind (mlp, linear); the checkpoint's "
                f"gates are kind {gates[0].kind!r}: use attention_gate")
    return None


def load_checked(cfg: EvalConfig, load: Loader | None, policies: dict[str, Policy],
                 ) -> tuple[Any, Any, dict[str, Policy], dict[str, Any]]:
    """(model, tokenizer, policies, store meta): load the model, drop from ``all`` the learned
    gates it cannot run (every one on a base model), check that a gate policy has the gate it
    needs."""
    from kvgate.gate import gate_modules
    from kvgate.models.limits import quiet_length_warning

    model, tokenizer, meta = (load or load_model)(cfg)
    quiet_length_warning(tokenizer)  # the model's own context is checked where items are built
    gates = gate_modules(model)
    if cfg.all_policies:  # 'all': every policy this model can run
        policies = {n: p for n, p in policies.items() if gate_refusal(p, gates) is None}
    check = [cfg.build_reference()] if isinstance(cfg, MatchedConfig) else policies.values()
    for policy in check:
        refusal = gate_refusal(policy, gates)
        if refusal is not None:
            raise EvalError(refusal)
    return model, tokenizer, policies, meta


def _loaded(cfg: EvalConfig, load: Loader | None,
            policies: dict[str, Policy]) -> tuple[Any, Any, dict[str, Policy], ResultStore]:
    """:func:`load_checked`, then open the store."""
    model, tokenizer, policies, meta = load_checked(cfg, load, policies)
    return model, tokenizer, policies, ResultStore(Path(cfg.out), meta, settings=cfg.settings())


@contextlib.contextmanager
def _kept_on_interrupt(store: ResultStore):
    """The examples scored since the store's last timed write are written when Ctrl-C stops
    the run (the command line then says they were kept): a rerun skips them."""
    try:
        yield
    except KeyboardInterrupt:
        store.flush()
        raise


def _finish(store: ResultStore, extra: list[Path] | None = None) -> EvalOutput:
    return EvalOutput(store, [*write_outputs(store), *(extra or [])])


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


def load_texts(cfg: CorpusConfig) -> list[str]:
    from kvgate.data import load_corpus, load_text_files

    if cfg.text_files:
        return load_text_files(cfg.text_files)
    docs = load_corpus(None, seed=cfg.seed)
    return docs[-cfg.docs:]


def write_patterns(model: Any, tokenizer: Any, tasks: dict[str, list[Any]],
                   policies: dict[str, Policy], budget: Budget, samples: int,
                   out: Path, cfg: TaskConfig | None = None) -> list[Path]:
    """Eviction-pattern plots of the first ``samples`` examples of the first task (cut as
    ``cfg``'s ``max_length`` and ``truncate`` say)."""
    from kvgate.eval.masked import masked_scores
    from kvgate.eval.multiple_choice import tokenize_tasks
    from kvgate.eval.report import plot_eviction_pattern
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


# ---------------------------------------------------------------------------------------------
# the commands


def run_mc(cfg: MCConfig, load: Loader | None = None) -> EvalOutput:
    """Every (task, policy, budget) at fixed budgets; eviction patterns of a thresholded gate."""
    from kvgate.eval.multiple_choice import evaluate_mc

    model, tokenizer, policies, store = _loaded(cfg, load, cfg.build_policies())
    tasks = load_tasks(cfg)
    with _kept_on_interrupt(store):
        evaluate_mc(model, tokenizer, tasks, policies, cfg.budgets, cfg.mode, store,
                    batch_size=cfg.batch_size, max_length=cfg.max_length,
                    progress=cfg.progress, truncate=cfg.truncate)
    # thresholded gates (a ranked one has budgets: the `pattern` command draws it)
    gated = {n: p for n, p in policies.items() if needs_gate(p) and p.budget_free}
    extra = []
    if gated and cfg.patterns:
        extra = write_patterns(model, tokenizer, tasks, gated, Budget(ratio=1.0), cfg.patterns,
                               Path(cfg.out), cfg)
    return _finish(store, extra)


def run_matched(cfg: MatchedConfig, load: Loader | None = None) -> EvalOutput:
    """The reference policy, then the others at its per-example eviction."""
    from kvgate.eval.multiple_choice import evaluate_matched

    model, tokenizer, policies, store = _loaded(cfg, load, cfg.build_policies())
    reference, ref_label, ref_budget = cfg.build_reference(), cfg.reference_label, \
        cfg.reference_budget
    tasks = load_tasks(cfg)
    others = model.disable_adapter if cfg.others_on == "base" else None
    with _kept_on_interrupt(store):
        evaluate_matched(model, tokenizer, tasks, policies, reference, cfg.mode, store,
                         reference_name=ref_label, reference_budget=ref_budget,
                         batch_size=cfg.batch_size, max_length=cfg.max_length,
                         progress=cfg.progress, others=others, rounding=cfg.rounding,
                         truncate=cfg.truncate)
    extra = []
    if cfg.patterns and needs_gate(reference):
        extra = write_patterns(model, tokenizer, tasks, {ref_label: reference},
                               Budget(ratio=1.0) if reference.budget_free else ref_budget,
                               cfg.patterns, Path(cfg.out), cfg)
    return _finish(store, extra)


def run_scored(cfg: EvalConfig, load: Loader | None,
               score: Callable[[Any, Any, dict[str, Policy], ResultStore], list[str]],
               ) -> EvalOutput:
    """What a scoring command does around its scoring: load the model and open the store,
    ``score(model, tokenizer, policies, store)`` (it returns the result keys), add the paired
    differences of ``cfg.paired`` when it has one, write results.md and the plots."""
    model, tokenizer, policies, store = _loaded(cfg, load, cfg.build_policies())
    with _kept_on_interrupt(store):
        keys = score(model, tokenizer, policies, store)
    paired = getattr(cfg, "paired", None)
    if paired is not None:
        from kvgate.eval.paired import add_paired

        add_paired(store, keys, paired)
    return _finish(store)


def run_needle(cfg: NeedleConfig, load: Loader | None = None) -> EvalOutput:
    """Passkey accuracy per (length, depth, policy, budget)."""
    from kvgate.eval.needle import evaluate_needle

    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_needle(
        model, tokenizer, load_texts(cfg), cfg.lengths, cfg.depths, policies, cfg.budgets,
        store, scoring=cfg.scoring, mode=cfg.mode, samples=cfg.samples,
        distractors=cfg.distractors, max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size, seed=cfg.seed, progress=cfg.progress,
        query_aware=cfg.query_aware, scores=cfg.score))


def run_ruler(cfg: RulerConfig, load: Loader | None = None) -> EvalOutput:
    """RULER-style task families per (task, length, policy, budget), question-agnostic unless
    ``query_aware``."""
    from kvgate.eval.ruler.run import evaluate_ruler

    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_ruler(
        model, tokenizer, cfg.tasks, cfg.lengths, policies, cfg.budgets, store,
        depths=cfg.depths, limit=cfg.limit, query_aware=cfg.query_aware, chat=cfg.chat,
        seed=cfg.seed, max_new_tokens=cfg.max_new_tokens, progress=cfg.progress,
        source=cfg.source, scores=cfg.score))


def run_longbench(cfg: LongBenchConfig, load: Loader | None = None) -> EvalOutput:
    """LongBench tasks per (task, policy, budget) with LongBench's metrics, question-agnostic
    unless ``query_aware``. The data is read before the model loads: an unreachable hub or a
    bad folder fails at once."""
    from kvgate.eval.longbench.run import evaluate_longbench, load_examples

    examples = load_examples(cfg.tasks, cfg.source, cfg.limit)
    return run_scored(cfg, load, lambda model, tokenizer, policies, store: evaluate_longbench(
        model, tokenizer, examples, policies, cfg.budgets, store, max_length=cfg.max_length,
        query_aware=cfg.query_aware, chat=cfg.chat, max_new_tokens=cfg.max_new_tokens,
        progress=cfg.progress, scores=cfg.score))


def run_ppl(cfg: PPLConfig, load: Loader | None = None) -> EvalOutput:
    """Perplexity under eviction (per text, or over fixed windows with ``context``)."""
    from kvgate.eval.ppl import evaluate_ppl

    model, tokenizer, policies, store = _loaded(cfg, load, cfg.build_policies())
    with _kept_on_interrupt(store):
        evaluate_ppl(model, tokenizer, load_texts(cfg), policies, cfg.budgets, store,
                     mode=cfg.mode, max_length=cfg.max_length, prefix=cfg.prefix,
                     batch_size=cfg.batch_size, progress=cfg.progress, context=cfg.context,
                     continuation=cfg.continuation, windows=cfg.windows,
                     truncate=cfg.truncate, step=cfg.step, from_files=bool(cfg.text_files))
    return _finish(store)


def run_pattern(cfg: PatternConfig, load: Loader | None = None) -> EvalOutput:
    """Eviction-pattern plots of each policy at the first budget."""
    model, tokenizer, policies, store = _loaded(cfg, load, cfg.build_policies())
    paths = write_patterns(model, tokenizer, load_tasks(cfg), policies, cfg.budgets[0],
                           cfg.samples, Path(cfg.out), cfg)
    return _finish(store, paths)


def run_report(cfg: ReportConfig, load: Loader | None = None) -> EvalOutput:
    """results.md and the plots again from ``out/results.json`` (no model)."""
    from kvgate.data.cache import read_json
    from kvgate.eval.shape import check_results

    out = Path(cfg.out)
    data = read_json(out / "results.json")
    if data is None:
        raise EvalError(f"{out / 'results.json'}: no readable results")
    check_results(out / "results.json", data)
    return _finish(ResultStore(out, data.get("meta", {})))
