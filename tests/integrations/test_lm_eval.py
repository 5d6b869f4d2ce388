"""The lm-evaluation-harness model ``kvgate`` on a tiny random LLaMA with a character tokenizer:
its log-likelihoods equal kvgate's own cache-mode scorer, generation stops at stop strings,
and a 4-example ``kvgate_piqa`` run finishes without network access and writes results."""

from __future__ import annotations

import json
import math
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance
from training.kvtrain_fixtures import save_tiny_base

from kvgate.data.tasks import load_task
from kvgate.eval.multiple_choice import cache_scores, mc_item
from kvgate.integrations.lm_eval import TASKS_DIR
from kvgate.integrations.lm_eval import __main__ as entry
from kvgate.integrations.lm_eval.model import KVGateLM, LMEvalError
from kvgate.policies import Budget, get_policy


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    # long enough positions for PIQA at one token per character
    return save_tiny_base(tmp_path_factory.mktemp("lm_eval") / "llama",
                          max_position_embeddings=2048)


@pytest.fixture(scope="module")
def piqa():
    return load_task("piqa", limit=4)


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if args else kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("policy, options", [("full", {}), ("snapkv", {"window": 8})])
def test_loglikelihoods_equal_kvgates_own_cache_scorer(base, piqa, policy, options):
    lm = KVGateLM(pretrained=base, policy=policy, budget=0.5, batch_size=3, **options)
    items = [mc_item(ex, lm.tokenizer) for ex in piqa]
    want = cache_scores(lm.model, items, get_policy(policy, **options), Budget(ratio=0.5),
                        pad=lm.pad)
    got = lm.loglikelihood(_requests("loglikelihood", [(ex.context, choice) for ex in piqa
                                                        for choice in ex.choices]))
    flat = [ll for score in want for ll in score.loglik]
    assert [ll for ll, _ in got] == pytest.approx(flat, abs=1e-4, rel=1e-5)
    kept = sum(s.kept for s in want) / sum(s.total for s in want)
    assert lm.kept_fraction == pytest.approx(kept)
    assert (kept == 1.0) == (policy == "full")


def test_kvzip_runs_its_repeat_pass_under_lm_eval(base, piqa):
    """A PassScoring policy's extra passes run before the continuations are scored."""
    lm = KVGateLM(pretrained=base, policy="kvzip", budget=0.5, batch_size=2, chunk=16)
    got = lm.loglikelihood(_requests("loglikelihood", [(ex.context, ex.choices[0])
                                                        for ex in piqa[:2]]))
    assert len(got) == 2 and all(ll < 0 for ll, _ in got)
    assert 0.45 < lm.kept_fraction < 0.65


def test_eviction_changes_the_scores_and_greedy_flags_are_real(base):
    full = KVGateLM(pretrained=base, policy="full")
    snap = KVGateLM(pretrained=base, policy="snapkv", budget=0.25, window=4)
    context = "Question: what keeps a door shut in the wind?\nAnswer:"
    ctx = full.tok_encode(context)
    # the random model's greedy tokens (ids outside the tiny vocabulary decode to nothing)
    greedy = full.engine.generate([context], 6).token_ids[0]
    other = greedy[:-1] + [(greedy[-1] + 1) % 128]
    [(ll, is_greedy), (_, not_greedy)] = full._loglikelihood_tokens(
        [(None, ctx, greedy), (None, ctx, other)])
    assert is_greedy and not not_greedy and ll < 0
    [(ll_snap, _)] = snap.loglikelihood(_requests("loglikelihood", [(context, " a latch")]))
    [(ll_full, _)] = full.loglikelihood(_requests("loglikelihood", [(context, " a latch")]))
    assert abs(ll_snap - ll_full) > 1e-3


def test_rolling_loglikelihood_is_the_whole_texts_with_a_full_cache(base):
    text = "The cat sat on the mat while the dogs ran far away."
    lm = KVGateLM(pretrained=base, policy="full")
    [total] = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    ids = [lm.prefix_token_id] + lm.tok_encode(text, add_special_tokens=False)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0, :-1].double()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).sum()
    assert total == pytest.approx(float(want), abs=1e-3)
    # windows of 16 tokens, each after 8 compressed context tokens: every token scored once
    small = KVGateLM(pretrained=base, policy="snapkv", budget=0.5, window=2, max_length=16,
                     rolling_context=8)
    [windowed] = small.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    assert math.isfinite(windowed) and windowed < 0


def test_generate_until_stops_at_the_first_stop_string(base):
    lm = KVGateLM(pretrained=base, policy="snapkv", budget=0.5, window=4, batch_size=2)
    prompts = ["Question: how do you boil an egg?\nAnswer:", "The river bank was"]
    free = lm.generate_until(_requests("generate_until", [(p, {"max_gen_toks": 12, "until": []})
                                                          for p in prompts]))
    assert all(len(t) >= 6 for t in free), free
    stops = [t[3:5] for t in free]
    cut = lm.generate_until(_requests("generate_until", [
        (p, {"max_gen_toks": 12, "until": [s, "never-seen"]}) for p, s in zip(prompts, stops)]))
    assert cut == [t[:t.find(s)] for t, s in zip(free, stops)]
    [single] = lm.generate_until(_requests("generate_until", [
        (prompts[0], {"max_gen_toks": 12, "until": stops[0]})]))  # a string, not a list
    assert single == cut[0]


def test_bad_model_arguments_are_kvgate_errors(base):
    with pytest.raises(LMEvalError, match="pretrained"):
        KVGateLM()
    with pytest.raises(LMEvalError, match="windw"):
        KVGateLM(pretrained=base, policy="snapkv", windw=4)
    with pytest.raises(LMEvalError, match="batch_size"):
        KVGateLM(pretrained=base, batch_size="many")


def _unset_and_restore_after(monkeypatch):
    # setenv first so that monkeypatch records the variable's original state (absent or not):
    # the entry point sets these in-process, and later tests must not see them
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


def test_entry_point_adds_the_tasks_and_goes_offline_for_kvgate_tasks(monkeypatch):
    _unset_and_restore_after(monkeypatch)
    argv = entry.prepare(["--model", "kvgate", "--tasks", "kvgate_piqa", "--limit", "4"])
    assert argv[-2:] == ["--include_path", str(TASKS_DIR)]
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    argv = entry.prepare(["run", "--tasks=kvgate_piqa,hellaswag", "--include_path", "mine"])
    assert argv.count("--include_path") == 1 and "HF_HUB_OFFLINE" not in os.environ
    assert entry.prepare(["--help"]) == ["--help"]
    assert {p.stem for p in TASKS_DIR.glob("*.yaml")} == set(entry.TASK_NAMES)


def test_four_piqa_examples_run_offline_and_write_results(base, no_network, monkeypatch,
                                                          tmp_path):
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tracker = EvaluationTracker(output_path=str(tmp_path / "out"))
    results = lm_eval.simple_evaluate(
        model="kvgate", model_args=f"pretrained={base},policy=snapkv,budget=0.5,window=8",
        tasks=["kvgate_piqa"], limit=4, batch_size=4, device="cpu",
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        evaluation_tracker=tracker)
    row = results["results"]["kvgate_piqa"]
    assert 0.0 <= row["acc,none"] <= 1.0 and 0.0 <= row["acc_norm,none"] <= 1.0
    assert results["n-samples"]["kvgate_piqa"]["effective"] == 4
    tracker.save_results_aggregated(results=results, samples=None)
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1
    assert "kvgate_piqa" in json.loads(written[0].read_text())["results"]


def test_command_line_runs_kvgate_piqa_offline(base, no_network, monkeypatch, tmp_path, capsys):
    """``python -m kvgate.integrations.lm_eval`` in-process: lm-eval's own CLI with the model
    registered, the shipped tasks included and the hub switched off. Only lm-eval's indexing
    of its ~15,000 built-in task files is skipped here (10+ s; it reads no network)."""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    _unset_and_restore_after(monkeypatch)  # the entry point sets them
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(tmp_path)
    code = entry.main(["--model", "kvgate", "--model_args",
                       f"pretrained={base},policy=snapkv,budget=0.5,window=8",
                       "--tasks", "kvgate_piqa", "--limit", "4", "--device", "cpu",
                       "--batch_size", "4", "--output_path", str(tmp_path / "out")])
    assert code == 0 and os.environ["HF_DATASETS_OFFLINE"] == "1"
    printed = capsys.readouterr().out
    assert "kvgate_piqa" in printed and "acc_norm" in printed
    [written] = list((tmp_path / "out").rglob("results_*.json"))
    row = json.loads(written.read_text())["results"]["kvgate_piqa"]
    assert 0.0 <= row["acc,none"] <= 1.0


def test_a_user_error_through_the_entry_point_exits_2_in_one_line(base, monkeypatch, capsys,
                                                                  tmp_path):
    """Issue #46 case 14: the entry's one-line errors exited 1 where ``kvgate`` exits 2."""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    _unset_and_restore_after(monkeypatch)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(tmp_path)
    code = entry.main(["--model", "kvgate", "--model_args",
                       f"pretrained={base},policy=snapkv,windw=4", "--tasks", "kvgate_piqa",
                       "--limit", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "windw" in err[-1], err[-3:]
    # lm-eval's own log lines may come before (its handlers outlive earlier tests' streams);
    # our error never comes as a traceback
    assert not any("LMEvalError" in line for line in err), err[-5:]
