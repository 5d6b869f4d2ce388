"""What every evaluation command does around its own scoring: load the model (``load_model``)
and check the policies it can run, open the output folder's store (``loaded``), keep what was
scored when Ctrl-C stops it, add the paired differences (``run_scored``), read corpus texts
(``load_texts``); and ``kvgate eval report``. Each benchmark's command
(``kvgate.eval.benchmarks.<name>.command``) builds on these and returns an
:class:`EvalOutput`; the registry (``run_eval``) then writes results.md and the plots.
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

from kvgate.eval.config import CorpusConfig, EvalConfig, ReportConfig
from kvgate.eval.errors import EvalError
from kvgate.eval.store import ResultStore
from kvgate.policies.base import Policy

__all__ = ["EvalOutput", "kept_on_interrupt", "load_checked", "load_model", "load_texts",
           "loaded", "run_report", "run_scored"]

Loaded = tuple[Any, Any, dict[str, Any]]
Loader = Callable[[EvalConfig], Loaded]


@dataclass
class EvalOutput:
    """A command's store and its files: first what it drew itself (eviction patterns), then,
    once the registry has written them, results.md and the plots (``markdown`` is the
    results.md text)."""

    store: ResultStore
    paths: list[Path]
    markdown: str = ""

    def table(self) -> str:
        return self.markdown


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
    """A learned-gate policy (``attention_gate``, ``local_gate``, ``gate_rank``: the class
    declares ``needs_gate``): it runs only on a gated model."""
    return policy.needs_gate


def gate_refusal(policy: Policy, gates: list[Any]) -> str | None:
    """Why ``policy`` cannot run on a model carrying ``gates`` (its gate modules), or None."""
    from kvgate.gate import GATES
    from kvgate.policies.local_gate import LocalGatePolicy

    if not needs_gate(policy):
        return None
    if not gates:
        return f"policy {policy.name} needs a gated model: pass --checkpoint DIR"
    if isinstance(policy, LocalGatePolicy) and not all(g.local for g in gates):
        local = ", ".join(kind for kind, cls in GATES.items() if cls.local)
        return (f"policy {policy.name} needs a local gate kind ({local}); the checkpoint's "
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
    for policy in cfg.gate_checked(policies):
        refusal = gate_refusal(policy, gates)
        if refusal is not None:
            raise EvalError(refusal)
    return model, tokenizer, policies, meta


def loaded(cfg: EvalConfig, load: Loader | None,
           policies: dict[str, Policy]) -> tuple[Any, Any, dict[str, Policy], ResultStore]:
    """:func:`load_checked`, then open the store."""
    model, tokenizer, policies, meta = load_checked(cfg, load, policies)
    return model, tokenizer, policies, ResultStore(Path(cfg.out), meta, settings=cfg.settings())


@contextlib.contextmanager
def kept_on_interrupt(store: ResultStore):
    """The examples scored since the store's last timed write are written when Ctrl-C stops
    the run (the command line then says they were kept): a rerun skips them."""
    try:
        yield
    except KeyboardInterrupt:
        store.flush()
        raise


def finish(store: ResultStore, extra: list[Path] | None = None) -> EvalOutput:
    """What a command hands the registry: its store and the files it drew itself."""
    return EvalOutput(store, list(extra or []))


def load_texts(cfg: CorpusConfig) -> list[str]:
    from kvgate.data import load_corpus, load_text_files

    if cfg.text_files:
        return load_text_files(cfg.text_files)
    docs = load_corpus(None, seed=cfg.seed)
    return docs[-cfg.docs:]


def run_scored(cfg: EvalConfig, load: Loader | None,
               score: Callable[[Any, Any, dict[str, Policy], ResultStore], list[str]],
               ) -> EvalOutput:
    """What a scoring command does around its scoring: load the model and open the store,
    ``score(model, tokenizer, policies, store)`` (it returns the result keys), add the paired
    differences of ``cfg.paired`` when it has one (the registry then writes results.md and the
    plots)."""
    model, tokenizer, policies, store = loaded(cfg, load, cfg.build_policies())
    with kept_on_interrupt(store):
        keys = score(model, tokenizer, policies, store)
    paired = getattr(cfg, "paired", None)
    if paired is not None:
        from kvgate.eval.paired import add_paired

        add_paired(store, keys, paired)
    return finish(store)


def run_report(cfg: ReportConfig, load: Loader | None = None) -> EvalOutput:
    """results.md and the plots again from ``out/results.json`` (no model)."""
    from kvgate.data.cache import read_json
    from kvgate.eval.shape import check_results

    out = Path(cfg.out)
    data = read_json(out / "results.json")
    if data is None:
        raise EvalError(f"{out / 'results.json'}: no readable results")
    check_results(out / "results.json", data)
    return finish(ResultStore(out, data.get("meta", {})))
