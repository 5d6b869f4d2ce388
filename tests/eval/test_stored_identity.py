"""A stored result is reused only by a run with the same model and the same score-changing
settings (issue 36, case 1: ``--max-length 48`` into a folder scored without it printed the old
numbers, exit 0). Every setting that changes a score is refused in one line naming it and both
values; those that do not (batch size, --limit, ...) resume as before."""

from __future__ import annotations

import json

import pytest
from eval_fakes import CharTokenizer, cli

import kvgate.eval.commands
from kvgate.eval.errors import EvalError
from kvgate.eval.store import ResultStore

TEXT = ("The quick brown fox jumps over the lazy dog. It was a sunny day. The dog slept on. "
        "Birds sang in the trees while the fox ran off into the woods. ") * 3


@pytest.fixture
def tiny(monkeypatch, tiny_llama):
    """``kvgate eval`` on a tiny random model and a character tokenizer."""
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (tiny_llama, CharTokenizer(), {"model": "tiny",
                                                                   "checkpoint": None}))
    return tiny_llama



def texts(tmp_path, name="held_out.txt", text=TEXT):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def stored(folder):
    return json.loads((folder / "results.json").read_text())


def test_the_issue_case_max_length_into_a_folder_scored_without_it(capsys, tiny, tmp_path):
    out = tmp_path / "D"
    argv = ["eval", "mc", "--model", "x", "--tasks", "copa", "--policies", "full,snapkv",
            "--limit", "3", "--out", str(out), "--no-progress"]
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    before = (out / "results.json").read_text()
    code, printed, err = cli(capsys, *argv, "--max-length", "48")
    assert code == 2 and err.count("\n") == 1 and printed == ""
    assert "--max-length unset" in err and "--max-length 48" in err
    assert (out / "results.json").read_text() == before  # nothing written, nothing reused
    # another folder scores it; the first one still resumes at its own settings
    code, _, err = cli(capsys, *argv[:-3], "--out", str(tmp_path / "E"), "--no-progress",
                          "--max-length", "48")
    assert code == 0, err
    assert stored(tmp_path / "E")["results"]["mc|copa|full|none|masked"]["settings"][
        "max_length"] == 48
    assert cli(capsys, *argv)[0] == 0


MC = ["eval", "mc", "--tasks", "copa", "--policies", "full", "--limit", "2"]
NEEDLE = ["eval", "needle", "--policies", "full", "--lengths", "200", "--depths", "50",
          "--samples", "1"]
PPL = ["eval", "ppl", "--policies", "full", "--max-length", "40"]


# (command, first run's extra flags, second run's, the setting named, its two values)
CHANGES = [
    (MC, [], ["--max-length", "48"], "--max-length", "unset", "48"),
    (MC, [], ["--dtype", "float16"], "--dtype", "float32", "float16"),
    (MC, [], ["--split", "sft_test"], "--split", "validation", "sft_test"),
    (MC, [], ["--truncate"], "--truncate", "off", "on"),
    (MC, ["--num-fewshot", "1"], ["--num-fewshot", "1", "--fewshot-seed", "3"],
     "--fewshot-seed", "0", "3"),
    (MC, ["--num-fewshot", "1"], ["--num-fewshot", "1", "--fewshot-split", "sft_train"],
     "--fewshot-split", "validation", "sft_train"),
    (["eval", "matched", "--tasks", "copa", "--policies", "full", "--limit", "2",
      "--reference", "snapkv"], [], ["--max-length", "48"], "--max-length", "unset", "48"),
    (NEEDLE, [], ["--samples", "2"], "--samples", "1", "2"),
    (NEEDLE, [], ["--seed", "1"], "--seed", "0", "1"),
    (NEEDLE, [], ["--distractors", "3"], "--distractors", "9", "3"),
    (NEEDLE, ["--scoring", "generate"], ["--scoring", "generate", "--max-new-tokens", "2"],
     "--max-new-tokens", "8", "2"),
    (PPL, [], ["--max-length", "30"], "--max-length", "40", "30"),
    (PPL, [], ["--prefix", "0.25"], "--prefix", "0.5", "0.25"),
    (PPL, [], ["--truncate"], "--truncate", "off", "on"),
    (PPL, [], ["--dtype", "bf16"], "--dtype", "float32", "bfloat16"),
]


@pytest.mark.parametrize("command, first, second, flag, old, new", CHANGES,
                         ids=[f"{c[1]}{c[3]}" for c in CHANGES])
def test_a_changed_setting_is_refused_in_one_line(capsys, tiny, tmp_path, command, first,
                                                  second, flag, old, new):
    corpus = [] if command is MC or command[1] == "matched" else ["--text-files",
                                                                  texts(tmp_path)]
    argv = [*command, "--model", "x", "--out", str(tmp_path / "o"), "--no-progress", *corpus]
    code, _, err = cli(capsys, *argv, *first)
    assert code == 0, err
    before = (tmp_path / "o" / "results.json").read_text()
    code, _, err = cli(capsys, *argv, *second)
    assert code == 2 and err.count("\n") == 1, err
    assert f"scored with {flag} {old}," in err and f"this run has {flag} {new}:" in err
    assert (tmp_path / "o" / "results.json").read_text() == before


def test_the_texts_are_part_of_a_corpus_result(capsys, tiny, tmp_path):
    """Other files, or the same file with other contents, are refused too."""
    argv = [*PPL, "--model", "x", "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli(capsys, *argv, "--text-files", texts(tmp_path))[0] == 0
    code, _, err = cli(capsys, *argv, "--text-files", texts(tmp_path, "other.txt"))
    assert code == 2 and "--text-files" in err and "other.txt" in err
    edited = texts(tmp_path, text=TEXT.replace("fox", "cat"))  # same path, other tokens
    code, _, err = cli(capsys, *argv, "--text-files", edited)
    assert code == 2 and err.count("\n") == 1 and "scored on other tokens" in err


@pytest.mark.parametrize("first, second", [
    (["--batch-size", "1"], ["--batch-size", "4"]),
    ([], ["--limit", "3"]),  # only selects examples: the stored two are reused
    (["--patterns", "0"], ["--patterns", "2"]),
    ([], ["--fewshot-seed", "5"]),  # no demonstrations: their seed changes nothing
])
def test_settings_that_change_no_score_resume(capsys, tiny, tmp_path, first, second):
    argv = ["eval", "mc", "--tasks", "copa", "--policies", "full", "--model", "x", "--out",
            str(tmp_path), "--no-progress"]
    assert cli(capsys, *argv, "--limit", "2", *first)[0] == 0
    before = stored(tmp_path)["results"]["mc|copa|full|none|masked"]["examples"]
    code, _, err = cli(capsys, *argv, "--limit", "2", *second)
    assert code == 0, err
    after = stored(tmp_path)["results"]["mc|copa|full|none|masked"]["examples"]
    assert all(after[uid] == rec for uid, rec in before.items())  # reused, not rescored


def _strip(folder, *fields):
    """The results file as an older kvgate wrote it: without ``fields`` per key and example."""
    data = stored(folder)
    for record in data["results"].values():
        for name in fields:
            record.pop(name, None)
        for example in record["examples"].values():
            example.pop("input", None)
    (folder / "results.json").write_text(json.dumps(data))


def test_records_from_before_settings_resume_at_the_defaults_of_the_time(capsys, tiny, tmp_path):
    argv = [*MC, "--model", "x", "--out", str(tmp_path), "--no-progress"]
    assert cli(capsys, *argv)[0] == 0
    _strip(tmp_path, "settings")
    code, _, err = cli(capsys, *argv, "--limit", "3")  # the defaults: resumed
    assert code == 0, err
    record = stored(tmp_path)["results"]["mc|copa|full|none|masked"]
    assert record["n"] == 3 and record["settings"]["max_length"] is None
    _strip(tmp_path, "settings")
    code, _, err = cli(capsys, *argv, "--max-length", "48")
    assert code == 2 and "--max-length unset (stored before settings were" in err


def test_old_ppl_records_are_checked_against_their_own_fields(tmp_path):
    """Perplexity stored its max_length and prefix before it stored settings; a run from text
    files is refused on an old record (--text-files was unset by default then)."""
    record = {"kind": "ppl", "max_length": 40, "prefix": 0.5, "complete": True, "examples": {}}
    (tmp_path / "results.json").write_text(json.dumps(
        {"meta": {"model": "m", "checkpoint": None},
         "results": {"ppl|corpus|full|none|masked": record}}))
    settings = {"dtype": "float32", "text_files": None, "docs": 50, "seed": 0,
                "max_length": 40, "prefix": 0.5, "truncate": False}
    key = "ppl|corpus|full|none|masked"
    meta = {"model": "m", "checkpoint": None}
    ResultStore(tmp_path, meta, settings=settings).check_spec(key, None)
    with pytest.raises(EvalError, match="--max-length 40, but this run has --max-length 30"):
        ResultStore(tmp_path, meta, settings={**settings, "max_length": 30}).check_spec(key, None)
    with pytest.raises(EvalError, match="--text-files unset .*the default then"):
        ResultStore(tmp_path, meta, settings={**settings, "text_files": ["/a.txt"]}
                    ).check_spec(key, None)


def test_an_example_scored_on_other_tokens_is_refused(capsys, tiny, tmp_path):
    argv = [*MC, "--model", "x", "--out", str(tmp_path), "--no-progress"]
    assert cli(capsys, *argv)[0] == 0
    data = stored(tmp_path)
    example = next(iter(data["results"]["mc|copa|full|none|masked"]["examples"].values()))
    example["input"] = "0" * 16  # as if the prompt format had changed since
    (tmp_path / "results.json").write_text(json.dumps(data))
    code, _, err = cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "scored on other tokens" in err


def test_a_folder_of_other_weights_is_refused(tmp_path):
    ResultStore(tmp_path, {"model": "m", "checkpoint": "c", "weights": "aaaa"}).save()
    assert ResultStore(tmp_path, {"model": "m", "checkpoint": "c", "weights": "aaaa"})
    with pytest.raises(EvalError, match="other weights .*the model or checkpoint changed"):
        ResultStore(tmp_path, {"model": "m", "checkpoint": "c", "weights": "bbbb"})
    # a folder written before the digest takes the first one it sees
    ResultStore(tmp_path / "old", {"model": "m", "checkpoint": "c"}).save()
    store = ResultStore(tmp_path / "old", {"model": "m", "checkpoint": "c", "weights": "aaaa"})
    store.save()
    with pytest.raises(EvalError, match="other weights"):
        ResultStore(tmp_path / "old", {"model": "m", "checkpoint": "c", "weights": "bbbb"})


def test_weights_fingerprint_follows_a_local_folder(tmp_path):
    from kvgate.models.load import weights_fingerprint

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = weights_fingerprint(str(tmp_path))
    assert first == weights_fingerprint(str(tmp_path)) and len(first) == 16
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert weights_fingerprint(str(tmp_path)) != first
    assert weights_fingerprint("some-org/some-model") is None


def test_old_needle_records_read_as_query_aware(capsys, tiny, tmp_path):
    """Needle records from before the question-agnostic default compressed the question: they
    stay under their keys (``rank-masked``), a --query-aware run resumes them, and the default
    run scores its own ``-agnostic`` keys beside them."""
    argv = [*NEEDLE, "--model", "x", "--out", str(tmp_path), "--text-files", texts(tmp_path),
            "--no-progress"]
    assert cli(capsys, *argv, "--query-aware")[0] == 0
    data = stored(tmp_path)  # as stored before query_aware was a setting
    for record in data["results"].values():
        del record["settings"]["query_aware"]
    (tmp_path / "results.json").write_text(json.dumps(data))
    old = stored(tmp_path)["results"]
    assert list(old) == ["needle|200@50|full|none|rank-masked"]
    before = (tmp_path / "results.json").read_text()
    code, _, err = cli(capsys, *argv, "--query-aware")  # LEGACY query_aware: resumed as is
    assert code == 0, err
    assert (tmp_path / "results.json").read_text() == before
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    assert sorted(stored(tmp_path)["results"]) == ["needle|200@50|full|none|rank-masked",
                                                   "needle|200@50|full|none|rank-masked-agnostic"]
