"""``kvgate eval longbench`` end to end on a tiny model, a character tokenizer and save_to_disk
copies in kvpress's LongBench layout: keys, records, tables and plot, resume, refused settings,
the middle cut of over-long contexts, query-aware keys, one-line errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import cli, fake_loader, results

from kvgate.data.longctx import LongExample
from kvgate.eval import runner
from kvgate.eval.benchmarks.longbench.run import as_asked, build_items

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

datasets = pytest.importorskip("datasets")

FILLER = "Grass is green and the sky is blue. "


def _rows(task, contexts, questions, answers, classes=None, lengths=None):
    n = len(contexts)
    return {"context": contexts, "question": questions, "answer_prefix": ["Answer:"] * n,
            "answers": answers, "task": [task] * n, "all_classes": classes or [None] * n,
            "length": lengths or [100] * n, "max_new_tokens": [52] * n,
            "_id": [f"{task}{i}" for i in range(n)]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """kvpress's layout: one save_to_disk folder per task (a LongBench-E one among them)."""
    root = tmp_path_factory.mktemp("longbench")
    hotpot = _rows("hotpotqa",
                   ["Passage 1: The magic city is Paris. " + FILLER * 4,
                    FILLER * 3 + "Passage 2: The old capital was Kyoto. " + FILLER],
                   ["Question: Which is the magic city?\n", "Question: What was the capital?\n"],
                   [["Paris"], ["Kyoto", "Heian-kyo"]])
    classes = ["Location", "Number", "Human"]
    trec = _rows("trec-e",
                 ["Question: Where is Rome?\nType: Location\n" + FILLER * 3,
                  "Question: How many legs?\nType: Number\n" + FILLER * 3],
                 ["Question: Where is Paris?\n", "Question: How many eyes?\n"],
                 [["Location"], ["Number"]], classes=[classes, classes], lengths=[300, 6000])
    long = _rows("qasper", ["The key is 42. " + FILLER * 20], ["Question: What is the key?\n"],
                 [["42"]])
    for name, rows in (("hotpotqa", hotpot), ("trec-e", trec), ("qasper", long)):
        datasets.Dataset.from_dict(rows).save_to_disk(str(root / name))
    return root


@pytest.fixture(scope="module")
def model():
    return build(tiny_llama_config(max_position_embeddings=640))


@pytest.fixture
def loads(monkeypatch, model):
    return fake_loader(monkeypatch, model, char_tokenizer)




def base(source, out, *more):
    return ["eval", "longbench", "--model", "x", "--source", str(source), "--out", str(out),
            "--policies", "full,snapkv", "--budgets", "0.5", "--max-new-tokens", "4",
            "--no-progress", *more]


def test_longbench_end_to_end_resume_and_refusals(capsys, loads, source, tmp_path,
                                                   monkeypatch):
    out = tmp_path / "lb"
    run = base(source, out, "--tasks", "hotpotqa,trec-e")
    code, _, err = cli(capsys, *run, "--limit", "1")
    assert code == 0, err
    want = {f"longbench|{t}|{p}|agnostic" for t in ("hotpotqa", "trec-e")
            for p in ("full|none", "snapkv|0.5")}
    assert set(results(out)) == want

    # no --limit: only the second example of each key is scored
    scored = []
    real = runner.record
    monkeypatch.setattr(runner, "record",
                        lambda bench, it, asked: scored.append(it.uid) or real(bench, it, asked))
    code, _, err = cli(capsys, *run)
    assert code == 0, err
    assert sorted(scored) == ["longbench:hotpotqa:hotpotqa1"] * 2 + \
        ["longbench:trec-e:trec-e1"] * 2
    res = results(out)
    for key, rec in res.items():
        assert rec["complete"] and rec["n"] == 2 and rec["mode"] == "agnostic"
        assert rec["ci_low"] <= rec["acc"] <= rec["ci_high"] and rec["sec_per_example"] > 0
        assert rec["settings"]["source"] == str(source) and rec["settings"]["chat"] is True
        assert rec["metric"] == ("qa_f1" if "hotpotqa" in key else "classification")
        for ex in rec["examples"].values():
            assert {"output", "answers", "score", "seconds", "kept", "total", "dropped",
                    "length"} <= set(ex)
            assert 0 <= ex["score"] <= 100 and ex["dropped"] == 0
    assert res["longbench|hotpotqa|snapkv|0.5|agnostic"]["evict_pct"] == pytest.approx(50, abs=5)
    assert res["longbench|hotpotqa|full|none|agnostic"]["evict_pct"] == 0
    trec = res["longbench|trec-e|full|none|agnostic"]
    assert trec["examples"]["longbench:trec-e:trec-e0"]["answers"] == ["Location"]
    assert "acc_0-4k" in trec and "acc_4-8k" in trec  # LongBench-E's length buckets
    assert "acc_0-4k" not in res["longbench|hotpotqa|full|none|agnostic"]
    md = (out / "results.md").read_text()
    assert "### longbench" in md and "### longbench (average over tasks)" in md
    assert "| hotpotqa | qa_f1 | snapkv | 0.5 | agnostic | 2 |" in md
    assert "| trec-e | classification | full | none | agnostic | 2 |" in md
    assert "| snapkv | 0.5 | agnostic | 2 | 4 |" in md  # average: 2 tasks, 4 examples
    assert "### longbench-e (score by length)" in md
    assert (out / "longbench_accuracy_agnostic.png").read_bytes()[:4] == b"\x89PNG"

    # a third run scores nothing
    def refuse(*a, **k):
        raise AssertionError("a stored example was scored again")

    monkeypatch.setattr(runner, "record", refuse)
    before = (out / "results.json").read_text()
    code, _, err = cli(capsys, *run)
    assert code == 0, err
    assert results(out) == json.loads(before)["results"]
    monkeypatch.setattr(runner, "record", real)

    # a changed score-changing setting is refused in one line, nothing written
    code, _, err = cli(capsys, *run, "--max-length", "100")
    assert code == 2 and err.count("\n") == 1 and "--max-length unset" in err
    assert (out / "results.json").read_text() == before

    # query-aware: keys of its own; the full cache answers as it does question-agnostic
    code, _, err = cli(capsys, *base(source, out, "--tasks", "hotpotqa", "--policies", "full",
                                     "--query-aware"))
    assert code == 0, err
    both = results(out)
    aware = both["longbench|hotpotqa|full|none|query-aware"]["examples"]
    agnostic = both["longbench|hotpotqa|full|none|agnostic"]["examples"]
    assert [aware[u]["output"] for u in aware] == [agnostic[u]["output"] for u in aware]
    assert "| hotpotqa | qa_f1 | full | none | query-aware | 2 |" in \
        (out / "results.md").read_text()


def test_the_averaged_table_carries_the_paired_gap_and_the_teacher_score(capsys, loads, source,
                                                                         tmp_path):
    """--paired full --score generate,teacher: the average over tasks gets its paired
    difference (tasks matched one to one; [0, 0] for full itself, a plain average of the
    per-task gaps' means otherwise) and the mean greedy-exact score, as RULER's does."""
    from kvgate.eval.benchmarks.longbench.report import averages

    out = tmp_path / "lbp"
    code, _, err = cli(capsys, *base(source, out, "--tasks", "hotpotqa,trec-e", "--limit", "2",
                                     "--paired", "full", "--score", "generate,teacher"))
    assert code == 0, err
    recs = [dict(r, task=k.split("|")[1], policy=k.split("|")[2], budget=k.split("|")[3],
                 mode=k.split("|")[4], kind="longbench") for k, r in results(out).items()]
    avg = {a["policy"]: a for a in averages(recs)}
    assert (avg["full"]["paired"]["diff"], avg["full"]["paired"]["ci_high"]) == (0.0, 0.0)
    per_task = [r["paired"]["diff"] for r in recs if r["policy"] == "snapkv"]
    assert avg["snapkv"]["paired"]["diff"] == pytest.approx(sum(per_task) / len(per_task))
    assert avg["snapkv"]["paired"]["n"] == 4
    assert "teacher_acc" in avg["snapkv"]
    md = (out / "results.md").read_text()
    average = md[md.index("### longbench (average over tasks)"):]
    assert "vs full (paired)" in average and "greedy-exact %" in average
    assert "| +0.0 [0.0, 0.0] |" in average


def test_over_long_contexts_are_refused_or_cut_in_the_middle(capsys, loads, source, tmp_path):
    run = base(source, tmp_path / "q", "--tasks", "qasper", "--policies", "full")
    code, _, err = cli(capsys, *run)
    assert code == 2 and err.count("\n") == 1
    assert "longbench qasper example longbench:qasper:qasper0" in err
    fit = int(re.search(r"--max-length (\d+)", err).group(1))
    assert not (tmp_path / "q" / "results.json").exists()
    code, _, err = cli(capsys, *run, "--max-length", str(fit))
    assert code == 0, err
    [rec] = results(tmp_path / "q").values()
    [ex] = rec["examples"].values()
    assert rec["settings"]["max_length"] == fit
    assert ex["dropped"] == len("The key is 42. " + FILLER * 20) - fit
    assert ex["n_ctx"] <= fit + 1  # the cut context (and the tokenizer's <s>)


def test_unknown_tasks_and_an_offline_hub_fail_in_one_line(capsys, loads, source, tmp_path,
                                                           monkeypatch):
    code, _, err = cli(capsys, *base(source, tmp_path / "a", "--tasks", "hotpotqa,nope"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --tasks: unknown LongBench task 'nope'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = cli(capsys, *base("hub", tmp_path / "b", "--tasks", "hotpotqa"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "Xnhyacinth/LongBench" in err and "unreachable" in err
    assert not loads  # the data is read first: no model was loaded for either


def test_items_fill_an_empty_question_and_skip_the_template_where_longbench_does():
    tok = char_tokenizer()
    ex = LongExample("ctx", "", "Summary:", ["s"], "gov_report", "g0")
    asked = as_asked(ex, "short ctx")
    assert (asked.context, asked.question, asked.answer_prefix) == ("short ctx", "Summary:", "")
    bare = as_asked(LongExample("c", " ", "", ["x"], "vcsum", "v0"), "c")
    assert bare.question == "Answer:"
    [item] = build_items(tok, "gov_report", [ex], max_new_cap=8)
    assert item.question.max_new_tokens == 8
    assert item.fields["n_ctx"] == len(tok("ctx")["input_ids"])
    assert build_items(tok, "trec", [ex])[0].meta["chat"] is False
    assert build_items(tok, "gov_report", [ex])[0].question.max_new_tokens == 512
    twice = build_items(tok, "gov_report", [ex, ex])
    assert [it.uid for it in twice] == ["g0", "g0#1"]
