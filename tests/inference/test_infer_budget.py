"""``kvgate infer --budget`` with a policy that sets its own eviction (issue #64 case 14): the
full cache or a thresholded gate ignored it while the statistics said "(0.3 of the prompt)";
now one warning line says so, and the statistics claim no budget."""

from __future__ import annotations

import json

import pytest
from conftest import build, patch_evicting, tiny_llama_config
from engine_toys import char_tokenizer

import kvgate.models
from kvgate.cli import main


@pytest.fixture
def tiny(monkeypatch):
    """load_base -> a tiny model carrying a local gate that evicts about half its entries."""
    def load(*args, **kwargs):
        model = build(tiny_llama_config())
        patch_evicting(model, "mlp")
        return model, char_tokenizer()

    monkeypatch.setattr(kvgate.models, "load_base", load)


def infer(capsys, *argv):
    code = main(["infer", "--model", "x", "--prompt", "hello there, a prompt", "--max-new-tokens",
                 "2", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def policy_row(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("policy "))


@pytest.mark.parametrize("policy, dial", [("full", ""),
                                          ("local_gate", "; --policy-opt local_gate.tau sets")])
def test_a_budget_a_policy_ignores_is_one_warning_and_not_claimed(capsys, tiny, policy, dial):
    code, out, err = infer(capsys, "--policy", policy, "--budget", "0.3")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [line for line in err.splitlines() if line.strip()]  # nothing else
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: --budget 0.3 has no effect with policy '{policy}', which sets its own "
        f"eviction{dial}")
    assert policy_row(out).endswith(f"{policy} (no budget: its own rule)")
    assert "0.3" not in out
    code, out, err = infer(capsys, "--policy", policy, "--budget", "0.3", "--json")
    assert json.loads(out)["stats"]["budget"] == "no budget: its own rule"


def test_a_budget_a_policy_uses_is_claimed_without_a_warning(capsys, tiny):
    code, out, err = infer(capsys, "--policy", "snapkv", "--budget", "0.5")
    assert code == 0 and "warning" not in err
    assert policy_row(out).endswith("snapkv (0.5 of the prompt)")
    code, out, err = infer(capsys, "--policy", "full")  # no --budget given: nothing to warn of
    assert code == 0 and "warning" not in err
