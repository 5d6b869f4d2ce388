"""A benchmark added as docs/ARCHITECTURE.md says (its config, run function and report written
in one file, here this one, and one ``COMMANDS`` line) runs end to end from the command line,
with its help written from its config and its own table in results.md; paired differences
are seeded and a policy against itself differs by exactly [0, 0]."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import build, tiny_llama_config
from eval_fakes import cli, results

import kvgate.eval.commands
from kvgate.eval.columns import column_table
from kvgate.eval.command import Command, Report
from kvgate.eval.commands import run_scored
from kvgate.eval.config import EvalConfig, parse_budgets
from kvgate.eval.options import opt
from kvgate.eval.paired import paired_difference
from kvgate.eval.qa_options import check_qa, paired_opt, score_opt
from kvgate.eval.registry import COMMANDS
from kvgate.eval.runner import Cell, QABenchmark, run_qa, text_item

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

TOY = QABenchmark("toy", lambda item, text: {"score": 100.0 * (item.answers[0] in text)})


@dataclass
class ToyConfig(EvalConfig):
    """Copy the first word of a short text (a toy benchmark)."""

    limit: int = opt(2, "examples")
    budgets: str | list = opt("0.5", "kept ratios")
    score: str | list[str] = score_opt()
    paired: str | None = paired_opt()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.budgets = parse_budgets(self.budgets)
        check_qa(self)

    def settings(self):
        return {**super().settings(), "score": self.score}


def run_toy(cfg: ToyConfig, load=None):
    def score(model, tokenizer, policies, store):
        items = [text_item(tokenizer, f"toy:{i}", f"word{i} is first, then more words.",
                           "Which word is first?", "It is", [f"word{i}"], 4)
                 for i in range(cfg.limit)]
        return run_qa(model, tokenizer, TOY, [Cell("copy", items)], policies, cfg.budgets,
                      store, scores=cfg.score, progress=cfg.progress)

    return run_scored(cfg, load, score)


TOY_COMMAND = Command(ToyConfig, run_toy, Report("toy", lambda rows: column_table(
    "toy", [("task", "task"), ("policy", "policy"), ("budget", "budget"), ("n", "n"),
            ("acc", "score %")], rows)))


@pytest.fixture
def toy(monkeypatch):
    model = build(tiny_llama_config())
    monkeypatch.setitem(COMMANDS, "toy", TOY_COMMAND)
    monkeypatch.setattr(kvgate.eval.commands, "load_model",
                        lambda cfg: (model, char_tokenizer(), {"model": "tiny",
                                                               "checkpoint": None}))


def test_a_benchmark_added_through_the_registry_runs_end_to_end(capsys, toy, tmp_path):
    with pytest.raises(SystemExit):
        cli(capsys, "eval", "toy", "--help")
    help_text = capsys.readouterr().out
    assert "Copy the first word" in help_text and "examples (default 2)" in help_text
    assert "--paired POLICY" in help_text and "``" not in help_text

    code, _, err = cli(capsys, "eval", "toy", "--model", "x", "--out", str(tmp_path),
                       "--policies", "full,snapkv", "--score", "generate,teacher",
                       "--paired", "full", "--no-progress")
    assert code == 0, err
    res = results(tmp_path)
    assert set(res) == {"toy|copy|full|none|agnostic", "toy|copy|snapkv|0.5|agnostic"}
    for rec in res.values():
        assert rec["complete"] and rec["n"] == 2 and rec["settings"]["score"] == [
            "generate", "teacher"]
        assert 0 <= rec["agree_pct"] <= 100 and rec["teacher_ll"] < 0
        for ex in rec["examples"].values():
            [gold] = ex["teacher"]
            assert gold["tokens"] == char_tokenizer()(f" word{ex['answers'][0][-1]}",
                                                      add_special_tokens=False)["input_ids"]
            assert ex["teacher_score"] == 100.0 * gold["exact"] and "output" in ex
    full = res["toy|copy|full|none|agnostic"]["paired"]
    assert (full["diff"], full["ci_low"], full["ci_high"], full["n"]) == (0.0, 0.0, 0.0, 2)
    assert res["toy|copy|snapkv|0.5|agnostic"]["paired"]["policy"] == "full"
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("### toy") and "| copy | snapkv | 0.5 | 2 |" in table

    code, _, err = cli(capsys, "eval", "toy", "--model", "x", "--out", str(tmp_path / "b"),
                       "--score", "guess")
    assert code == 2 and err.startswith("error: --score must be one or both of")
    code, _, err = cli(capsys, "eval", "toy", "--model", "x", "--out", str(tmp_path / "b"),
                       "--paired", "h2o", "--policies", "full")
    assert code == 2 and "--paired h2o: not a label of --policies" in err


def _rows(scores_by_family):
    return [{"examples": {f"e{i}": {"score": s} for i, s in enumerate(scores)}}
            for scores in scores_by_family]


def test_paired_interval_is_deterministic_and_zero_against_itself():
    mine = _rows([[100, 0, 100, 100, 0, 100], [50, 50, 0, 100]])
    ref = _rows([[0, 0, 100, 0, 0, 100], [50, 0, 0, 100]])
    again = paired_difference(mine, ref, seed=3)
    assert again == paired_difference(mine, ref, seed=3)
    assert again["n"] == 10 and again["diff"] == pytest.approx((200 / 6 + 50 / 4) / 2)
    assert again["ci_low"] <= again["diff"] <= again["ci_high"]
    assert paired_difference(mine, ref, seed=4) == again  # nothing is resampled
    self_diff = paired_difference(mine, mine, seed=3)
    assert (self_diff["diff"], self_diff["ci_low"], self_diff["ci_high"]) == (0.0, 0.0, 0.0)
    # only the examples both hold are paired
    partial = paired_difference(mine, _rows([[0, 0], [50]]))
    assert partial["n"] == 3
