"""``kvgate demo``: the document, the check of an answer against its fact, and the command end
to end on a tiny gated model (the table, the JSON rows, the heuristics at the gate's share)."""

from __future__ import annotations

import json

import pytest
from conftest import patch_evicting
from kvtrain_fixtures import save_tiny_base

from kvgate.demo import FACTS, demo_document, demo_table, holds_fact
from kvgate.demo.document import DemoError
from kvgate.demo.run import DemoRow


def test_an_answer_holds_its_fact_in_any_case_and_punctuation_but_not_in_part():
    assert holds_fact("It was Clara Voss.", "Clara Voss")
    assert holds_fact("clara   VOSS founded it", "Clara Voss")
    assert holds_fact("In 1847, I think", "1847")
    assert not holds_fact("Clara founded it", "Clara Voss")
    assert not holds_fact("18470", "1847")  # whole words only
    assert not holds_fact("anything", "")


class _Chars:
    """Counts one token per character: lengths are easy to reason about."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text)))}


def test_the_document_holds_every_fact_in_order_near_its_depth_and_about_its_length():
    text = demo_document(_Chars(), tokens=6000)
    at = [text.index(f.sentence) for f in FACTS]
    assert at == sorted(at)
    for offset, fact in zip(at, FACTS):
        assert abs(offset / len(text) - fact.depth) < 0.2
    assert 3000 < len(text) <= 6000
    assert text.count("\n\n") >= 3  # whole passages, one paragraph each
    with pytest.raises(DemoError, match="more tokens"):
        demo_document(_Chars(), tokens=200)


def test_the_document_shares_no_13_word_run_with_the_training_corpus():
    """The gate has never seen the document: BoolQ is an evaluation set, which the corpus
    builder's leak test keeps out of every training document."""
    from kvgate.data.corpus import load_corpus
    from kvgate.data.overlap import NgramIndex

    docs = load_corpus(max_docs=400)  # the documents cpt_kvzap and the main job train on
    index = NgramIndex(docs)
    passages = demo_document(_Chars(), tokens=12000).split("\n\n")
    assert not index.overlaps(passages).any()


def test_the_gist_drops_the_opening_words_that_repeat_the_question():
    from kvgate.demo.run import gist

    q = "What is the password to the museum's map room?"
    assert gist("The password to the museum's map room is silver heron.", q) == "silver heron."
    assert gist("In what year? It was 1847.", "In what year was it lit?") == "1847."
    assert gist("the map room", q) == "room"  # never empty: the last word stays


def test_a_cell_is_the_answers_first_sentence_with_its_end_kept():
    from kvgate.demo.run import _cell

    assert _cell("silver heron. And more text.", 20) == "silver heron."
    assert _cell("was founded by a woman named Clara Voss.", 20) == "...named Clara Voss."


def test_the_table_marks_each_answer_and_counts_the_facts_held():
    rows = [DemoRow("full cache", 1.0, 2 << 20, 2 << 20, ["Clara Voss", "1847"],
                    [True, True]),
            DemoRow("tova", 0.5, 1 << 20, 2 << 20, ["a cook", "1847"], [False, True])]
    table = demo_table(rows, ["Who?", "When?"], ["Clara Voss", "1847"], marks=("Y", "N"))
    lines = table.splitlines()
    assert lines[0] == "Q1: Who?  (fact: Clara Voss)"
    assert "| full cache | 100.0% | 2.0 MiB of 2.0 MiB | Y Clara Voss | Y 1847 | 2/2 |" in lines
    assert "| tova | 50.0% | 1.0 MiB of 2.0 MiB | N a cook | Y 1847 | 1/2 |" in lines


@pytest.fixture
def gated(tmp_path):
    from kvgate.checkpoint import export_gated
    from kvgate.gate import gate_modules
    from kvgate.models import load_base, model_fingerprint

    base = save_tiny_base(tmp_path / "base", max_position_embeddings=4096)
    model, _ = load_base(base)
    patch_evicting(model, "mlp")
    export_gated(model, tmp_path / "gated", base_model=base,
                 fingerprint=model_fingerprint(model.config),
                 gate_config=gate_modules(model)[0].config)
    return tmp_path / "gated"


def test_the_command_runs_end_to_end_and_prints_the_table(gated, capsys):
    from kvgate.cli import main as kvgate_main

    args = ["demo", "--checkpoint", str(gated), "--tokens", "2500", "--max-new-tokens", "2"]
    assert kvgate_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["rows"]}
    assert list(rows) == ["full cache", "learned gate (local_gate)", "tova", "snapkv"]
    assert out["questions"] == [f.question for f in FACTS]
    assert rows["full cache"]["kept_fraction"] == 1.0
    gate = rows["learned gate (local_gate)"]["kept_fraction"]
    assert 0.0 < gate < 1.0
    for name in ("tova", "snapkv"):  # the heuristics keep the gate's share (per-head rounding)
        assert rows[name]["kept_fraction"] == pytest.approx(gate, abs=0.02)
        assert rows[name]["bytes_held"] < rows["full cache"]["bytes_held"]
    for row in rows.values():
        assert len(row["answers"]) == 3 and all(h in (True, False) for h in row["holds"])
    assert kvgate_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Q1: ") and "(fact: Clara Voss)" in lines[0]
    header = next(line for line in lines if line.startswith("| policy"))
    assert header == "| policy | kept | KV bytes held | Q1 | Q2 | Q3 | facts held |"
    assert sum(line.startswith("| ") for line in lines) == 5
    assert lines[-1].startswith("KV bytes held: ")


def test_ones_own_document_and_questions(gated, tmp_path, capsys):
    from kvgate.cli import main as kvgate_main

    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat. " * 30)
    assert kvgate_main(["demo", "--checkpoint", str(gated), "--context-file", str(doc),
                        "--question", "where did the cat sit?", "--policies", "full,gate",
                        "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["rows"]] == ["full cache", "learned gate (local_gate)"]
    assert out["rows"][0]["holds"] == [None]  # no fact given: nothing to check


@pytest.mark.parametrize("args,needle", [
    (["--question", "why?"], "--context-file"),
    (["--context-file", "DOC", "--question", "a?", "--question", "b?", "--answer", "x"],
     "one per question"),
    (["--context-file", "DOC"], "--question"),
    (["--policies", "full,nosuch"], "nosuch"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_input_is_one_line_before_the_model_loads(gated, tmp_path, capsys, args, needle):
    from kvgate.cli import main as kvgate_main

    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    args = [str(doc) if a == "DOC" else a for a in args]
    assert kvgate_main(["demo", "--checkpoint", str(gated), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_without_the_main_jobs_gate_it_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    from kvgate.cli import main as kvgate_main

    monkeypatch.chdir(tmp_path)
    assert kvgate_main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "scripts/main.sh" in err


def test_the_readmes_python_example_runs(gated, tmp_path, monkeypatch, capsys):
    """The README's example, on the tiny gated model and a short document in place of the main
    job's export and the user's report."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert "runs/cpt_kvzap_quick/gated" in code and "report.txt" in code
    (tmp_path / "report.txt").write_text("the cat sat on the mat. " * 20)
    monkeypatch.chdir(tmp_path)
    code = code.replace("runs/cpt_kvzap_quick/gated", str(gated)).replace(
        "max_new_tokens=24", "max_new_tokens=2")
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 (the README's own code)
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"kept \d+%, [\d,]+ bytes", out[0]) and len(out) == 4
