"""``kvgate eval ruler`` end to end on a tiny model and a character tokenizer: keys, records,
tables and plots, resume, refused settings and lengths, question-agnostic vs query-aware."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import cli, results

import kvgate.eval.commands
from kvgate.eval.benchmarks.ruler.run import build_items
from kvgate.eval.benchmarks.ruler.tasks import generate
from kvgate.eval.intervals import mean_interval, stratified_interval, wilson
from kvgate.inference.compress import SEPARATOR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

BASE = ["eval", "ruler", "--model", "x", "--tasks", "niah_single_1,vt", "--lengths", "300,360",
        "--depths", "0,100", "--policies", "full,snapkv", "--budgets", "0.5",
        "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture(scope="module")
def model():
    return build(tiny_llama_config(max_position_embeddings=640))


@pytest.fixture
def tiny(monkeypatch, model):
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, char_tokenizer(), {"model": "tiny",
                                                               "checkpoint": None}))
    return model




def test_ruler_end_to_end_resume_and_refusals(capsys, tiny, tmp_path):
    out = tmp_path / "r"
    code, _, err = cli(capsys, *BASE, "--limit", "2", "--out", str(out))
    assert code == 0, err
    res = results(out)
    want = {f"ruler|{t}@{n}|{p}|agnostic" for t in ("niah_single_1", "vt") for n in (300, 360)
            for p in ("full|none", "snapkv|0.5")}
    assert set(res) == want
    for key, rec in res.items():
        assert rec["complete"] and rec["n"] == 2 and rec["mode"] == "agnostic"
        assert rec["ci_low"] <= rec["acc"] <= rec["ci_high"] and rec["sec_per_example"] > 0
        assert rec["settings"]["query_aware"] is False and rec["settings"]["depths"] == [0, 100]
        for uid, ex in rec["examples"].items():
            assert {"output", "answers", "score", "seconds", "kept", "total"} <= set(ex)
            assert 0 <= ex["score"] <= 100
            if "niah" in key:  # example s at depth s mod 2
                assert ex["depth"] == (0.0 if ":0:" in uid else 100.0)
    assert res["ruler|vt@300|snapkv|0.5|agnostic"]["evict_pct"] == pytest.approx(50, abs=5)
    assert res["ruler|vt@300|full|none|agnostic"]["evict_pct"] == 0
    md = (out / "results.md").read_text()
    assert "### ruler (average over task families)" in md and "| 300 | snapkv | 0.5 |" in md
    for png in ("ruler_accuracy_300_agnostic.png", "ruler_niah_snapkv_0.5_agnostic.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # a larger --limit scores only the missing example; the stored ones stay as they were
    code, _, err = cli(capsys, *BASE, "--limit", "3", "--out", str(out))
    assert code == 0, err
    again = results(out)
    for key in want:
        assert again[key]["n"] == 3
        for uid, ex in res[key]["examples"].items():
            assert again[key]["examples"][uid] == ex

    # a changed score-changing setting is refused in one line, nothing written
    before = (out / "results.json").read_text()
    code, _, err = cli(capsys, *BASE, "--limit", "2", "--seed", "1", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "--seed 0" in err and "--seed 1" in err
    code, _, err = cli(capsys, *BASE, "--limit", "2", "--depths", "50", "--out", str(out))
    assert code == 2 and "--depths" in err
    assert (out / "results.json").read_text() == before

    # query-aware: its own keys beside the agnostic ones; the full cache answers the same
    code, _, err = cli(capsys, *BASE, "--limit", "2", "--query-aware", "--out", str(out))
    assert code == 0, err
    both = results(out)
    aware = {k.replace("|agnostic", "|query-aware") for k in want}
    assert set(both) == want | aware
    for task in ("niah_single_1@300", "vt@360"):
        a = both[f"ruler|{task}|full|none|agnostic"]["examples"]
        q = both[f"ruler|{task}|full|none|query-aware"]["examples"]
        assert [a[u]["output"] for u in q] == [q[u]["output"] for u in q]
        s_a = both[f"ruler|{task}|snapkv|0.5|agnostic"]["examples"]
        s_q = both[f"ruler|{task}|snapkv|0.5|query-aware"]["examples"]
        assert all(s_q[u]["total"] > s_a[u]["total"] for u in s_q)  # the question was held too
    assert "| query-aware |" in (out / "results.md").read_text()


def test_lengths_past_the_model_and_bad_tasks_are_refused(capsys, tiny, tmp_path):
    code, _, err = cli(capsys, *BASE, "--lengths", "600", "--out", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1
    assert "at length 600" in err and "use --lengths of at most" in err
    assert not (tmp_path / "a" / "results.json").exists()
    code, _, err = cli(capsys, *BASE, "--tasks", "niah_single_9", "--out", str(tmp_path / "b"))
    assert code == 2 and "unknown RULER task 'niah_single_9'" in err


def test_items_cycle_depths_and_match_the_engine_split():
    tok = char_tokenizer()
    items = build_items(tok, "niah_single_1", 300, [0, 50, 100], 4)
    assert [it.fields["depth"] for it in items] == [0.0, 50.0, 100.0, 0.0]
    # plain prompts: the context as Engine.compress encodes it (specials included), then the
    # question part as Engine.answer does
    for s, it in enumerate(items):
        ex = generate("niah_single_1", tok, 300, [0.0, 0.5, 1.0, 0.0][s], seed=s)
        assert list(it.context) == tok(ex.context)["input_ids"]
        assert list(it.question.ids) == tok(SEPARATOR + ex.question + "\n" + ex.answer_prefix,
                                            add_special_tokens=False)["input_ids"]
        assert it.fields["n_ctx"] == len(it.context) and it.answers == tuple(ex.answers)
    assert all(300 <= it.fields["n_ctx"] <= 301 for it in items)
    assert [it.fields["depth"] for it in build_items(tok, "vt", 300, [0, 50], 2)] == [None, None]


def test_intervals():
    lo, hi = wilson(5, 10)
    assert lo < 50 < hi and 0 <= lo and hi <= 100
    assert wilson(10, 10)[1] == pytest.approx(100.0)
    assert mean_interval([0.0, 100.0, 100.0]) == wilson(2, 3)
    lo, hi = mean_interval([50.0, 75.0, 100.0, 25.0])
    assert 25.0 <= lo <= 62.5 <= hi <= 100.0
    lo, hi = stratified_interval([[100.0, 100.0], [0.0, 0.0]])
    assert lo == hi == 50.0


def test_ruler_from_a_local_copy_of_kvpress_ruler(capsys, tiny, tmp_path):
    """``--source PATH``: kvpress's RULER layout (a save_to_disk folder per length) is scored
    the same way; the examples' own tokens to generate are used, capped by --max-new-tokens."""
    from datasets import Dataset

    rows = {"context": ["The magic number is 7261. " + "Grass is green. " * 8,
                        "Filler text here. " * 6 + "VAR X = 42. "],
            "question": ["What is the magic number?", "Which variable is 42?"],
            "answer_prefix": ["Answer:", "Answer:"],
            "answer": [["7261"], ["X"]],
            "task": ["niah_single_1", "vt"],
            "max_new_tokens": [3, 2]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ruler" / "4096"))
    out = tmp_path / "r"
    code, _, err = cli(capsys, "eval", "ruler", "--model", "x", "--tasks", "niah_single_1,vt",
                       "--lengths", "4096", "--policies", "full,snapkv", "--budgets", "0.5",
                       "--source", str(tmp_path / "ruler"), "--no-progress", "--out", str(out))
    assert code == 0, err
    res = results(out)
    assert set(res) == {f"ruler|{t}@4096|{p}|agnostic" for t in ("niah_single_1", "vt")
                        for p in ("full|none", "snapkv|0.5")}
    rec = res["ruler|niah_single_1@4096|full|none|agnostic"]
    assert rec["n"] == 1 and rec["settings"]["source"] == str(tmp_path / "ruler")
    [ex] = rec["examples"].values()
    assert ex["answers"] == ["7261"] and ex["depth"] is None
    # another copy into the same folder is another setting: refused in one line
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "other" / "4096"))
    code, _, err = cli(capsys, "eval", "ruler", "--model", "x", "--tasks", "vt", "--lengths",
                       "4096", "--policies", "full", "--source", str(tmp_path / "other"),
                       "--no-progress", "--out", str(out))
    last = err.strip().splitlines()[-1]  # after datasets' own progress bars
    assert code == 2 and last.startswith("error: ") and "--source" in last


def test_one_shot_policies_share_each_examples_prefill(capsys, tiny, tmp_path, monkeypatch):
    """Question-agnostic one-shot policies are scored from one prefill per example: the
    records equal each policy's own compress + answer; RoCo (a streamed prefill) runs alone;
    a key added later scores only itself."""
    from kvgate.eval import runner
    from kvgate.eval.benchmarks.ruler.run import RULER
    from kvgate.policies import get_policy
    from kvgate.policies.base import Budget

    calls = []
    real = runner.ask_shared
    monkeypatch.setattr(runner, "ask_shared", lambda m, t, ctx, q, want, scores, *kv: calls.append(
        (ctx, sorted(want))) or real(m, t, ctx, q, want, scores, *kv))
    argv = ["eval", "ruler", "--model", "x", "--tasks", "niah_single_1", "--lengths", "300",
            "--limit", "2", "--max-new-tokens", "4", "--no-progress", "--budgets", "0.5,0.25"]
    out = tmp_path / "s"
    code, _, err = cli(capsys, *argv, "--policies", "full,snapkv,h2o,roco", "--out", str(out))
    assert code == 0, err
    shared = [f"ruler|niah_single_1@300|{p}|agnostic" for p in
              ("full|none", "snapkv|0.5", "snapkv|0.25", "h2o|0.5", "h2o|0.25")]
    assert len(calls) == 2 and all(want == sorted(shared) for _, want in calls)
    res = results(out)
    items = {it.uid: it for it in build_items(char_tokenizer(), "niah_single_1", 300, (0, 25, 50, 75, 100), 2,
                                              max_new_cap=4)}
    for key in shared:
        _, _, name, bud, _ = key.split("|")
        budget = Budget(ratio=1.0 if bud == "none" else float(bud))
        for uid, ex in res[key]["examples"].items():
            it = items[uid]
            alone = runner.record(RULER, it, runner.ask_agnostic(
                tiny, char_tokenizer(), it.context, it.question, get_policy(name), budget,
                ["generate"]))
            assert (ex["output"], ex["kept"], ex["score"]) == (
                alone["output"], alone["kept"], alone["score"]), (key, uid)
            assert ex["shared_prefill"] == 5
    assert "shared_prefill" not in next(iter(res[
        "ruler|niah_single_1@300|roco|0.5|agnostic"]["examples"].values()))
    calls.clear()
    code, _, err = cli(capsys, *argv, "--policies", "full,snapkv,h2o,tova", "--out", str(out))
    assert code == 0, err
    assert [want for _, want in calls] == [sorted(
        f"ruler|niah_single_1@300|tova|{b}|agnostic" for b in ("0.5", "0.25"))] * 2


def test_a_run_killed_mid_group_keeps_every_record_its_shared_prefills_made(
        capsys, tiny, tmp_path, monkeypatch):
    """The first key of a shared group stores every key's record of an example as soon as
    that example is scored: killed at its second example, the run leaves the first one stored
    under all three keys, and the rerun scores only the second."""
    import json

    from kvgate.eval import runner
    from kvgate.eval.store import ResultStore

    monkeypatch.setattr(ResultStore.__init__, "__defaults__", (0.0, None))  # write every put
    calls, kill = [], [True]
    real = runner.ask_shared

    def ask(m, t, ctx, q, want, scores, *kv):
        if calls and kill[0]:
            raise RuntimeError("killed")
        calls.append(sorted(want))
        return real(m, t, ctx, q, want, scores, *kv)

    monkeypatch.setattr(runner, "ask_shared", ask)
    argv = ["eval", "ruler", "--model", "x", "--tasks", "niah_single_1", "--lengths", "300",
            "--limit", "2", "--max-new-tokens", "4", "--no-progress", "--budgets", "0.5",
            "--policies", "full,snapkv,h2o", "--out", str(tmp_path / "k")]
    with pytest.raises(RuntimeError, match="killed"):
        cli(capsys, *argv)
    stored = json.loads((tmp_path / "k" / "results.json").read_text())["results"]
    assert len(stored) == 3 and all(len(r["examples"]) == 1 and not r["complete"]
                                    for r in stored.values())
    first = {next(iter(r["examples"])) for r in stored.values()}
    assert len(first) == 1 and len(calls) == 1
    kill[0] = False
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    assert len(calls) == 2 and calls[1] == calls[0]  # the second example only, for all three
    res = results(tmp_path / "k")
    assert all(r["complete"] and len(r["examples"]) == 2 for r in res.values())


@pytest.mark.parametrize("flags", [[], ["--query-aware"]])
def test_kvzip_runs_its_repeat_pass_in_ruler(capsys, tiny, tmp_path, flags):
    """KVzip (its own prefill, then the repeat pass) and KVzip+ ranked globally, asked after
    compression and query-aware (prefill then decode)."""
    out = tmp_path / "k"
    code, _, err = cli(capsys, "eval", "ruler", "--model", "x", "--tasks", "vt", "--lengths",
                       "300", "--depths", "0", "--policies", "kvzip,kzg=kvzip", "--policy-opt",
                       "kzg.plus=true", "--policy-opt", "kzg.allocation=global", "--budgets",
                       "0.5", "--max-new-tokens", "2", "--limit", "1", "--no-progress",
                       "--out", str(out), *flags)
    assert code == 0, err
    res = results(out)
    assert len(res) == 2
    for rec in res.values():
        assert rec["complete"] and rec["evict_pct"] == pytest.approx(50, abs=5)
def test_kvzip_variants_share_each_examples_repeat_pass(capsys, tiny, tmp_path, monkeypatch):
    """KVzip and KVzip+ per head and global at two budgets: one prefill and one repeat pass per
    example serve all eight keys (a SharedPasses), beside the one-shot policies' own shared
    prefill; every record equals the variant's own compress + answer."""
    from kvgate.eval import runner
    from kvgate.eval.benchmarks.ruler.run import RULER
    from kvgate.policies.base import Budget

    calls = []
    real = runner.ask_shared
    monkeypatch.setattr(runner, "ask_shared", lambda m, t, ctx, q, want, scores, *kv: calls.append(
        sorted(want)) or real(m, t, ctx, q, want, scores, *kv))
    out = tmp_path / "z"
    code, _, err = cli(capsys, "eval", "ruler", "--model", "x", "--tasks", "niah_single_1",
                       "--lengths", "300", "--limit", "2", "--max-new-tokens", "4",
                       "--no-progress", "--budgets", "0.5,0.25", "--policies",
                       "full,snapkv,kvzip,kzg=kvzip,kzp=kvzip,kzpg=kvzip",
                       "--policy-opt", "kzg.allocation=global", "--policy-opt", "kzp.plus=true",
                       "--policy-opt", "kzpg.plus=true", "--policy-opt",
                       "kzpg.allocation=global", "--out", str(out))
    assert code == 0, err
    key = "ruler|niah_single_1@300|{}|agnostic".format
    passes = sorted(key(f"{p}|{b}") for p in ("kvzip", "kzg", "kzp", "kzpg")
                    for b in ("0.5", "0.25"))
    prefill = sorted([key("full|none"), key("snapkv|0.5"), key("snapkv|0.25")])
    assert sorted(map(tuple, calls)) == sorted([tuple(prefill)] * 2 + [tuple(passes)] * 2)
    res = results(out)
    items = {it.uid: it for it in build_items(char_tokenizer(), "niah_single_1", 300,
                                              (0, 25, 50, 75, 100), 2, max_new_cap=4)}
    from kvgate.eval.config import parse_policies  # how the CLI built each policy

    policies = parse_policies("kvzip,kzg=kvzip,kzp=kvzip,kzpg=kvzip",
                              ["kzg.allocation=global", "kzp.plus=true", "kzpg.plus=true",
                               "kzpg.allocation=global"])
    for k in passes:
        _, _, name, bud, _ = k.split("|")
        for uid, ex in res[k]["examples"].items():
            it = items[uid]
            alone = runner.record(RULER, it, runner.ask_agnostic(
                tiny, char_tokenizer(), it.context, it.question, policies[name],
                Budget(ratio=float(bud)), ["generate"]))
            assert (ex["output"], ex["kept"], ex["score"]) == (
                alone["output"], alone["kept"], alone["score"]), (k, uid)
            assert ex["shared_prefill"] == 8


def test_teacher_scores_and_paired_differences_reach_the_tables(capsys, tiny, tmp_path):
    """--score generate,teacher: records carry the gold answers' tokens, greedy-exact and
    log-likelihood, keys their agreement; --paired full: every row's difference to full on
    the same examples, [0, 0] for full itself, per family and averaged."""
    out = tmp_path / "t"
    code, _, err = cli(capsys, "eval", "ruler", "--model", "x", "--tasks", "niah_single_1,vt",
                       "--lengths", "300", "--limit", "2", "--policies", "full,snapkv",
                       "--max-new-tokens", "4", "--no-progress", "--score", "generate,teacher",
                       "--paired", "full", "--out", str(out))
    assert code == 0, err
    res = results(out)
    for key, rec in res.items():
        assert 0 <= rec["agree_pct"] <= 100 and rec["settings"]["score"] == ["generate",
                                                                             "teacher"]
        for ex in rec["examples"].values():
            assert len(ex["teacher"]) == len(ex["answers"]) and "output" in ex
            assert all(t["tokens"] and t["ll"] < 0 for t in ex["teacher"])
        if "|full|" in key:
            assert (rec["paired"]["diff"], rec["paired"]["ci_low"], rec["paired"]["ci_high"]) \
                == (0.0, 0.0, 0.0)
    md = (out / "results.md").read_text()
    assert md.count("vs full (paired)") == 2 and md.count("greedy-exact %") == 2
    assert "| +0.0 [0.0, 0.0] |" in md


def test_the_first_refusal_gives_the_length_every_task_fits(capsys, tiny, tmp_path):
    """Issue #64 case 8: --lengths 9000 said "at most 8,000", 8000 was then refused with
    7,998, then 7,996, then 7,940 (another task's question each round). The first refusal
    now gives a length at which every task asked fits, and it runs."""
    argv = [*BASE[:4], "--tasks", "niah_single_1,vt,cwe,fwe", "--policies", "full", "--limit",
            "2", "--max-new-tokens", "4", "--no-progress"]
    code, _, err = cli(capsys, *argv, "--lengths", "700", "--out", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1
    fits = int(err.split("use --lengths of at most ")[1].split(" ")[0].rstrip("\n"))
    code, _, err = cli(capsys, *argv, "--lengths", str(fits), "--out", str(tmp_path / "b"))
    assert code == 0, err
    code, _, err = cli(capsys, *argv, "--lengths", str(fits + 1), "--out", str(tmp_path / "c"))
    assert code == 2 and f"use --lengths of at most {fits} (every task asked fits there)" in err


def test_averaged_rows_at_the_edges_have_intervals_of_width():
    """Issue #64 case 9: at --limit 2 every family at 100 printed "100.0-100.0" and a paired
    gap of 100 "[100, 100]" from two examples a family."""
    from kvgate.eval.benchmarks.ruler.report import averages, ruler_markdown

    def rec(policy, budget, family, score):
        return {"kind": "ruler", "family": family, "length": 300, "policy": policy,
                "budget": budget, "mode": "agnostic", "n": 2, "acc": score, "ci_low": 0.0,
                "ci_high": 100.0, "evict_pct": 0.0, "sec_per_example": 1.0,
                "examples": {f"{family}:{i}": {"score": score} for i in range(2)},
                **({"paired": {"policy": "full", "n": 2, "diff": -100.0, "ci_low": -100.0,
                                "ci_high": -20.0}} if policy != "full" else {})}

    rows = [rec("full", "none", f, 100.0) for f in ("vt", "cwe")] + [
        rec("snapkv", "0.5", f, 0.0) for f in ("vt", "cwe")]
    avg = {a["policy"]: a for a in averages(rows)}
    full, snap = avg["full"], avg["snapkv"]
    assert full["ci_low"] == pytest.approx(wilson(4, 4)[0]) and full["ci_high"] == 100.0
    assert snap["ci_low"] == 0.0 and snap["ci_high"] == pytest.approx(wilson(0, 4)[1])
    gap = snap["paired"]
    assert gap["diff"] == -100.0 and gap["ci_low"] == pytest.approx(-100.0)
    assert -100.0 < gap["ci_high"] < -25.0
    assert "100.0-100.0" not in ruler_markdown(rows)
