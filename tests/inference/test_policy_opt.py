"""One ``--policy-opt`` syntax for ``kvgate infer`` and ``kvgate eval`` (issue #64 case 6): infer
took ``KEY=VALUE`` and eval ``NAME.KEY=VALUE``, and the README's inference paragraph showed
``NAME.tau``. Both now take both, where the policy is unambiguous."""

from __future__ import annotations

import pytest
from conftest import build, tiny_llama_config
from engine_toys import char_tokenizer

import kvgate.cli.train  # Lightning's log handler takes the real stderr on import, not capsys's
import kvgate.eval.commands
import kvgate.models
from kvgate.cli import main
from kvgate.eval.benchmarks.mc.config import MCConfig
from kvgate.eval.errors import EvalError


@pytest.fixture
def tiny_base(monkeypatch):
    monkeypatch.setattr(kvgate.models, "load_base",
                        lambda *a, **k: (build(tiny_llama_config()), char_tokenizer()))


@pytest.fixture
def no_model(monkeypatch):
    def refuse(cfg):
        raise AssertionError("the model must not load when the arguments are wrong")

    monkeypatch.setattr(kvgate.eval.commands, "load_model", refuse)


def infer(capsys, *argv):
    code = main(["infer", "--model", "x", "--prompt", "hello", "--max-new-tokens", "2",
                 "--policy", "snapkv", "--budget", "0.5", *argv])
    return code, capsys.readouterr().err


def test_infer_takes_evals_name_key_form(capsys, tiny_base):
    """The README's ``--policy-opt NAME.tau=...`` form, and the plain one, side by side."""
    from kvgate.cli.infer import parse_policy_options

    assert parse_policy_options(["snapkv.window=4", "pooling=mean"], "snapkv") == {
        "window": 4, "pooling": "mean"}
    assert parse_policy_options(["attention_gate.tau=0.6"], "attention_gate") == {"tau": 0.6}
    code, err = infer(capsys, "--policy-opt", "snapkv.window=4")
    assert code == 0, err


def test_infer_refuses_an_option_of_another_policy_naming_the_right_form(capsys, tiny_base):
    code, err = infer(capsys, "--policy-opt", "h2o.window=4")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --policy-opt 'h2o.window=4': the policy is 'snapkv', not "
                          "'h2o'; write snapkv.window=4 (or window=4)")


def test_eval_takes_infers_key_form_with_one_policy(tmp_path):
    cfg = MCConfig(out=str(tmp_path), model="x", tasks="copa", policies="snapkv",
                   policy_opt=["window=4", "snapkv.pooling=avg"])
    policy = cfg.build_policies()["snapkv"]
    assert (policy.window, policy.pooling) == (4, "avg")
    with pytest.raises(EvalError, match="expected NAME.KEY=VALUE, NAME a label of --policies "
                                        r"\(KEY=VALUE only when --policies names one\)"):
        MCConfig(out=str(tmp_path), model="x", tasks="copa", policies="snapkv,h2o",
                 policy_opt=["window=4"])


def test_eval_refuses_a_bare_key_among_several_policies_in_one_line(capsys, no_model, tmp_path):
    code = main(["eval", "mc", "--model", "x", "--tasks", "copa", "--out", str(tmp_path),
                 "--policies", "snapkv,h2o", "--policy-opt", "window=4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "NAME.KEY=VALUE" in err
