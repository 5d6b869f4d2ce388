"""``python -m kvgate.eval``: one-line errors before the model loads, and an end-to-end run."""

import json

import pytest
import torch
from eval_fakes import CharTokenizer
from research_fixtures import research_policies  # noqa: F401 - gate_hybrid's tests

import kvgate.eval.__main__ as cli
import kvgate.eval.commands
from kvgate.eval.config import parse_policies
from kvgate.gate import GateConfig, patch


@pytest.fixture
def no_model(monkeypatch):
    def refuse(args):
        raise AssertionError("the model must not load when the arguments are wrong")

    monkeypatch.setattr(kvgate.eval.commands, "load_model", refuse)


@pytest.fixture
def tiny_cli(monkeypatch, tiny_llama):
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda args: (tiny_llama, CharTokenizer(),
                                      {"model": "tiny", "checkpoint": None}))
    return tiny_llama


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,message", [
    (["--tasks", "rte,nope"], "unknown task 'nope'"),
    (["--policies", "full,snapcv"], "unknown policy 'snapcv'"),
    (["--budgets", "abc"], "budget 'abc' is neither a ratio nor a token count"),
    (["--budgets", "0"], "budget ratio must lie in (0, 1]"),
    (["--budgets", "1.5"], "budget ratio must lie in (0, 1]"),
    (["--policies", "full", "--policy-opt", "snapkv.window=4"], "not in --policies"),
    (["--policies", "snapkv", "--policy-opt", "snapkv.windw=4"], "has no option 'windw'"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
])
def test_bad_arguments_fail_in_one_line_before_loading(capsys, no_model, tmp_path, args, message):
    code, _, err = run(capsys, "mc", "--model", "x", "--out", str(tmp_path), *args)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message in err


def test_needle_lists_must_be_numbers(capsys, no_model, tmp_path):
    code, _, err = run(capsys, "needle", "--model", "x", "--out", str(tmp_path),
                       "--lengths", "1k")
    assert code == 2 and "--lengths" in err


def test_learned_gate_needs_a_checkpoint(capsys, tiny_cli, tmp_path):
    code, _, err = run(capsys, "mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa",
                       "--policies", "attention_gate", "--limit", "2")
    assert code == 2 and "needs a gated model" in err


def test_mc_end_to_end_and_resume(capsys, tiny_cli, tmp_path):
    argv = ["mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa",
            "--policies", "full,window", "--budgets", "0.5,0.25", "--limit", "3",
            "--no-progress"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "| copa | window | 0.25 | masked | 3 |" in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted(results) == ["mc|copa|full|none|masked", "mc|copa|window|0.25|masked",
                               "mc|copa|window|0.5|masked"]
    assert (tmp_path / "results.md").is_file()
    assert (tmp_path / "accuracy_vs_eviction.png").read_bytes()[:4] == b"\x89PNG"
    before = (tmp_path / "results.json").read_text()
    code, _, _ = run(capsys, *argv)  # everything is complete: nothing is recomputed
    assert code == 0 and json.loads(before) == json.loads((tmp_path / "results.json").read_text())
    code, out3, _ = run(capsys, "report", "--out", str(tmp_path))
    assert code == 0 and "| copa | full | none | masked | 3 |" in out3


def test_few_shot_prompts_are_scored_under_their_own_task_label(capsys, tiny_cli, tmp_path):
    common = ["mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa",
              "--policies", "full", "--limit", "3", "--no-progress"]
    assert run(capsys, *common)[0] == 0
    code, out, _ = run(capsys, *common, "--num-fewshot", "2")
    assert code == 0 and "| copa@2shot | full | none | masked | 3 |" in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    zero, two = (results[f"mc|{t}|full|none|masked"]["examples"] for t in ("copa", "copa@2shot"))
    assert zero.keys() == two.keys()
    # two solved examples and two blank lines more context, in characters (CharTokenizer)
    assert all(two[u]["n_ctx"] > zero[u]["n_ctx"] + 20 for u in zero)
    code, _, err = run(capsys, *common, "--num-fewshot", "2", "--fewshot-split", "test")
    assert code == 2 and err.count("\n") == 1 and "copa: split 'test' does not ship" in err


def test_a_label_reused_with_other_options_is_refused(capsys, tiny_cli, tmp_path):
    """Each result stores its policy's spec; a later run that gives the same label other
    options (here SnapKV's window) stops with one line instead of mixing the two policies."""
    argv = ["mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa", "--budgets", "0.5",
            "--policies", "s=snapkv", "--no-progress"]
    code, _, err = run(capsys, *argv, "--limit", "2", "--policy-opt", "s.window=4")
    assert code == 0, err
    record = json.loads((tmp_path / "results.json").read_text())["results"]["mc|copa|s|0.5|masked"]
    assert record["spec"]["policy"] == "snapkv" and record["spec"]["options"]["window"] == 4
    before = (tmp_path / "results.json").read_text()
    code, _, err = run(capsys, *argv, "--limit", "3", "--policy-opt", "s.window=8")
    assert code == 2 and err.count("\n") == 1
    assert "scored with snapkv options" in err and "give it another label" in err
    assert (tmp_path / "results.json").read_text() == before  # nothing written
    code, _, err = run(capsys, *argv, "--limit", "3", "--policy-opt", "s.window=4")  # resumes
    assert code == 0, err
    record = json.loads((tmp_path / "results.json").read_text())["results"]["mc|copa|s|0.5|masked"]
    assert record["n"] == 3


def test_results_of_another_model_are_not_mixed(capsys, tiny_cli, tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"model": "other"},
                                                       "results": {}}))
    code, _, err = run(capsys, "mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa",
                       "--limit", "1")
    assert code == 2 and "use another --out folder" in err


@pytest.mark.parametrize("command, args", [
    ("mc", ["--tasks", "copa", "--mode", "cache", "--limit", "2"]),
    ("ppl", ["--mode", "cache", "--docs", "2", "--max-length", "48"]),
])
def test_kvzip_runs_its_repeat_pass_in_cache_mode(capsys, tiny_cli, tmp_path, command, args):
    """The cache-mode scorers hand the tokenizer over, so KVzip's passes run before the
    continuations are scored (a cache without them would refuse the continuation)."""
    code, _, err = run(capsys, command, "--model", "x", "--out", str(tmp_path), "--policies",
                       "kvzip", "--policy-opt", "kvzip.chunk=16", "--no-progress", *args)
    assert code == 0, err
    (record,) = json.loads((tmp_path / "results.json").read_text())["results"].values()
    assert record["complete"] and 40 < record["evict_pct"] < 60


def test_matched_end_to_end_with_patterns(capsys, monkeypatch, tiny_llama, tmp_path):
    torch.manual_seed(0)
    patch(tiny_llama, GateConfig(gamma=0.0))
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda args: (tiny_llama, CharTokenizer(),
                                      {"model": "tiny", "checkpoint": "c"}))
    code, out, err = run(capsys, "matched", "--checkpoint", "c", "--out", str(tmp_path),
                         "--tasks", "copa", "--policies", "window,h2o", "--limit", "3",
                         "--patterns", "2", "--no-progress")
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted(results) == ["mc|copa|attention_gate|none|masked",
                               "mc|copa|h2o|matched-attention_gate|masked",
                               "mc|copa|window|matched-attention_gate|masked"]
    assert sorted(p.name for p in tmp_path.glob("pattern_*.png")) == [
        "pattern_attention_gate_copa_0.png", "pattern_attention_gate_copa_1.png"]
    assert "matched-attention_gate" in out
    # --rounding nearest: the same folder gains H2O under its own label; the gate is not re-run
    code, out, err = run(capsys, "matched", "--checkpoint", "c", "--out", str(tmp_path),
                         "--tasks", "copa", "--policies", "h2o", "--limit", "3",
                         "--rounding", "nearest", "--no-progress")
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert "mc|copa|h2o|matched~attention_gate|masked" in results and len(results) == 4


def test_matched_reference_takes_a_label_and_its_own_options(capsys, monkeypatch, tiny_llama,
                                                             tmp_path):
    torch.manual_seed(0)
    patch(tiny_llama, GateConfig(gamma=0.0))
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda args: (tiny_llama, CharTokenizer(),
                                      {"model": "tiny", "checkpoint": "c"}))
    common = ["--checkpoint", "c", "--tasks", "copa", "--policies", "h2o", "--limit", "4",
              "--patterns", "0", "--no-progress"]
    code, _, err = run(capsys, "matched", "--out", str(tmp_path / "a"), *common)
    assert code == 0, err
    code, _, err = run(capsys, "matched", "--out", str(tmp_path / "b"), *common,
                       "--reference", "ag80=attention_gate", "--policy-opt", "ag80.tau=0.8")
    assert code == 0, err
    plain = json.loads((tmp_path / "a" / "results.json").read_text())["results"]
    raised = json.loads((tmp_path / "b" / "results.json").read_text())["results"]
    assert sorted(raised) == ["mc|copa|ag80|none|masked", "mc|copa|h2o|matched-ag80|masked"]
    # the raised threshold evicts more, and H2O follows it example by example
    assert (raised["mc|copa|ag80|none|masked"]["evict_pct"]
            > plain["mc|copa|attention_gate|none|masked"]["evict_pct"])
    assert (raised["mc|copa|h2o|matched-ag80|masked"]["evict_pct"]
            > plain["mc|copa|h2o|matched-attention_gate|masked"]["evict_pct"])


def test_matched_reference_options_are_checked(capsys, no_model, tmp_path):
    code, _, err = run(capsys, "matched", "--model", "x", "--out", str(tmp_path),
                       "--reference", "ag=attention_gate", "--policy-opt", "ag.tau=2")
    assert code == 2 and "tau" in err and err.count("\n") == 1


def test_all_policies_on_a_base_model_skip_the_learned_gate(capsys, tiny_cli, tmp_path):
    code, _, err = run(capsys, "ppl", "--model", "x", "--out", str(tmp_path), "--policies",
                       "all", "--budgets", "0.5", "--text-files", str(_text(tmp_path)),
                       "--max-length", "24", "--no-progress")
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    policies = {key.split("|")[2] for key in results}
    assert "attention_gate" not in policies and {"full", "snapkv", "roco"} <= policies


def test_local_gate_needs_a_local_gate_kind_and_all_leaves_it_out_otherwise(
        capsys, monkeypatch, tiny_llama, tmp_path):
    patch(tiny_llama, GateConfig())  # the attention kind
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda args: (tiny_llama, CharTokenizer(),
                                      {"model": "tiny", "checkpoint": "c"}))
    common = ["ppl", "--checkpoint", "c", "--budgets", "0.5", "--text-files",
              str(_text(tmp_path)), "--max-length", "24", "--no-progress"]
    code, _, err = run(capsys, *common, "--out", str(tmp_path / "a"), "--policies", "local_gate")
    assert code == 2 and err.count("\n") == 1
    assert "needs a local gate kind (mlp, linear); the checkpoint's gates are kind 'attention'" in err
    code, _, err = run(capsys, *common, "--out", str(tmp_path / "b"), "--policies", "all")
    assert code == 0, err
    results = json.loads((tmp_path / "b" / "results.json").read_text())["results"]
    policies = {key.split("|")[2] for key in results}
    assert "attention_gate" in policies and "local_gate" not in policies


def _text(tmp_path):
    path = tmp_path / "held_out.txt"
    path.write_text("the quick brown fox jumps over the lazy dog again and again")
    return path


def test_one_policy_under_two_labels_with_different_options():
    policies = parse_policies("snapkv,snap10=snapkv", ["snap10.window=0.1"])
    assert list(policies) == ["snapkv", "snap10"]
    assert policies["snapkv"].window == 32 and policies["snap10"].window == 0.1
    assert policies["snap10"].name == "snapkv"
    from kvgate.eval.errors import EvalError

    with pytest.raises(EvalError, match="repeats a label"):
        parse_policies("snapkv,snapkv=h2o", [])


@pytest.mark.usefixtures("research_policies")
def test_a_json_option_reaches_the_policy_as_a_mapping():
    """select_options={"recent": 32} is parsed as JSON: the gate's H2O selector gets recent 32
    (gate_hybrid, the research policy of experiments/policies, registered as its CLI does)."""
    policies = parse_policies("sel=gate_hybrid", ["sel.select=h2o",
                                                      'sel.select_options={"recent": 32}'])
    assert policies["sel"].select_options == {"recent": 32}
    assert policies["sel"]._chooser.recent == 32


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A tiny base folder and an exported gates + LoRA checkpoint whose adapter moves logits."""
    from training.kvtrain_fixtures import save_tiny_base

    from kvgate.training.export import export_module
    from kvgate.training.module import KVGateModule

    root = tmp_path_factory.mktemp("lora_ck")
    base = save_tiny_base(root / "base")
    torch.manual_seed(1)
    module = KVGateModule(base_model=base, train="gates_lora", image_every_n_steps=0)
    module.configure_model()
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    gates_only = KVGateModule(base_model=base, train="gates", image_every_n_steps=0)
    gates_only.configure_model()
    return (base, export_module(module.eval(), root / "gated"),
            export_module(gates_only.eval(), root / "gates_only"))


def _examples(folder, key):
    results = json.loads((folder / "results.json").read_text())["results"]
    return {uid: ex["ll"] for uid, ex in results[key]["examples"].items()}


@pytest.mark.parametrize("mode", ["masked", "cache"])
def test_matched_others_on_the_base_switch_the_adapter_off(capsys, lora_checkpoint, tmp_path,
                                                          mode):
    base, ck, gates_only = lora_checkpoint
    common = ["--tasks", "copa", "--limit", "3", "--no-progress", "--mode", mode]
    for out, extra in (("on_base", ["--others-on", "base"]), ("on_ck", [])):
        code, _, err = run(capsys, "matched", "--checkpoint", str(ck), "--policies", "full",
                           "--out", str(tmp_path / out), *common, *extra)
        assert code == 0, err
    code, _, err = run(capsys, "mc", "--model", base, "--policies", "full",
                       "--out", str(tmp_path / "base"), *common)
    assert code == 0, err
    full_base = _examples(tmp_path / "base", f"mc|copa|full|none|{mode}")
    full_on_base = _examples(tmp_path / "on_base", f"mc|copa|full|matched-attention_gate|{mode}")
    full_on_ck = _examples(tmp_path / "on_ck", f"mc|copa|full|matched-attention_gate|{mode}")
    gate = f"mc|copa|attention_gate|none|{mode}"
    # the others run on the bare base; the reference keeps its adapter (unmerged == merged)
    for uid, scores in full_base.items():
        assert full_on_base[uid] == pytest.approx(scores, abs=1e-4)
        assert _examples(tmp_path / "on_base", gate)[uid] == pytest.approx(
            _examples(tmp_path / "on_ck", gate)[uid], abs=1e-3)
    assert any(full_on_ck[uid] != pytest.approx(s, abs=1e-3) for uid, s in full_base.items())
    # one folder never mixes the two kinds of runs
    code, _, err = run(capsys, "matched", "--checkpoint", str(ck), "--policies", "full",
                       "--out", str(tmp_path / "on_ck"), *common, "--others-on", "base")
    assert code == 2 and "others_on" in err
    # without an adapter there is nothing to switch off
    code, _, err = run(capsys, "matched", "--checkpoint", str(gates_only), "--policies", "h2o",
                       "--out", str(tmp_path / "g"), *common, "--others-on", "base")
    assert code == 2 and "no LoRA adapter" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------- issue #46
def test_a_text_file_that_is_not_utf8_is_one_line_before_loading(capsys, no_model, tmp_path):
    """Issue #46 case 1: ``eval ppl --text-files`` with a Latin-1 file: a 31-line traceback."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"ok text, then caf\xe9")
    code, _, err = run(capsys, "ppl", "--model", "x", "--out", str(tmp_path / "o"),
                       "--text-files", str(path))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: text file {path}: not UTF-8 text (byte 0xe9 at offset 17)")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_an_out_that_is_a_file_or_inside_one_is_one_line(capsys, no_model, tmp_path, where):
    """Issue #46 case 9: ``eval mc --out`` a file (or below one): 38 lines of traceback."""
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "sub" / "out"
    for command in (["mc", "--model", "x", "--tasks", "copa"], ["report"]):
        code, _, err = run(capsys, *command, "--out", str(out))
        assert code == 2 and err.count("\n") == 1, err
        why = "is a file, not a folder" if where == "a file" else f"{tmp_path / 'afile'} is a file"
        assert err.startswith(f"error: --out {out}: {why}")
    assert (tmp_path / "afile").read_text() == "not a folder"


@pytest.mark.parametrize("damage, field", [
    ({"meta": "a string"}, "'meta' should be an object, found a string"),
    ({"results": []}, "'results' should be an object of results by key, found a list"),
    ({"examples": ["a", "b"]}, "examples should be an object of examples by id, found a list"),
    ({"key": "not-a-key"}, "result key 'not-a-key' is not kind|task|policy|budget|mode"),
])
def test_a_results_file_of_the_wrong_shape_is_one_line(capsys, tiny_cli, tmp_path, damage,
                                                       field):
    """Issue #46 case 4: valid JSON of the wrong shape ended ``eval report`` / a scoring run
    in a 30-41 line traceback."""
    argv = ["mc", "--model", "x", "--out", str(tmp_path), "--tasks", "copa", "--policies",
            "full", "--limit", "2", "--no-progress"]
    assert run(capsys, *argv)[0] == 0
    path = tmp_path / "results.json"
    data = json.loads(path.read_text())
    key = next(iter(data["results"]))
    if "examples" in damage:
        data["results"][key]["examples"] = damage["examples"]
    elif "key" in damage:
        data["results"][damage["key"]] = data["results"].pop(key)
    else:
        data.update(damage)
    path.write_text(json.dumps(data))
    for command in (argv, ["report", "--out", str(tmp_path)]):
        code, _, err = run(capsys, *command)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {path}: ") and field in err and "move it away" in err
    assert json.loads(path.read_text()) == data  # nothing rewritten


@pytest.mark.parametrize("extra, message", [
    (["--step", "1"], "--step feeds the continuation through a real cache: add --mode cache"),
    (["--step", "0", "--mode", "cache"], "--step must be >= 1, got 0"),
])
def test_ppl_step_needs_a_cache_and_a_positive_count(capsys, no_model, tmp_path, extra, message):
    code, _, err = run(capsys, "ppl", "--model", "x", "--out", str(tmp_path / "o"),
                       "--text-files", str(_text(tmp_path)), *extra)
    assert code == 2 and err.count("\n") == 1 and message in err
