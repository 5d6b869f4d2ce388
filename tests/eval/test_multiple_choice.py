"""Multiple-choice runs: tokenisation, accuracy from scores, resumability, matched budgets."""

import math

import pytest
import torch
from eval_fakes import CharTokenizer, CountingFull, RecordingSnapKV, direct_loglik
from research_fixtures import research_policies  # noqa: F401 - gate_hybrid's tests

from kvgate.data.tasks import MCExample
from kvgate.eval.errors import EvalError
from kvgate.eval.multiple_choice import (
    evaluate_matched,
    evaluate_mc,
    mc_item,
    mc_summary,
    run_items,
    score_batch,
    tokenize_tasks,
)
from kvgate.eval.resumable import evict_summary
from kvgate.eval.store import ResultStore, make_key
from kvgate.gate import GateConfig, patch
from kvgate.policies import Budget, PolicyError, get_policy

TOK = CharTokenizer()


def examples(n=6, task="toy"):
    out = []
    for i in range(n):
        ctx = f"Question {i}: is the {'cat' * (1 + i % 3)} on the mat? Answer:"
        out.append(MCExample(task, f"{task}:{i}", ctx, [" yes", " no", " maybe so"], i % 3))
    return out


def store(tmp_path, model="tiny"):
    return ResultStore(tmp_path, {"model": model, "checkpoint": None}, flush_s=0.0)


class SeamTokenizer(CharTokenizer):
    """Merges ':' + ' ' into one token, so a choice's first token depends on the context."""

    def __call__(self, text, add_special_tokens=True):
        ids = super().__call__(text.replace(": ", "\x7f"), add_special_tokens)["input_ids"]
        return {"input_ids": ids}


def test_mc_item_tokenises_like_the_harness():
    ex = MCExample("toy", "toy:0", "Answer:", [" yes", " no"], 1)
    item = mc_item(ex, TOK)
    assert item.context == tuple(TOK("Answer:")["input_ids"])  # BOS included
    assert item.choices == (tuple(TOK(" yes", False)["input_ids"]),
                            tuple(TOK(" no", False)["input_ids"]))
    assert item.choice_chars == (4, 3) and item.gold == 1
    # the seam token ': ' belongs to neither part: the choice falls back to its own encoding
    seam = mc_item(ex, SeamTokenizer())
    assert seam.choices[0] == tuple(SeamTokenizer()(" yes", False)["input_ids"])


def test_max_length_cuts_the_context_from_the_left():
    ex = MCExample("toy", "toy:0", "abcdefghij", [" xy", " z"], 0)
    item = mc_item(ex, TOK, max_length=6)
    assert len(item.context) == 3 and item.context == tuple(TOK("hij", False)["input_ids"])
    with pytest.raises(EvalError, match="longer than max_length"):
        mc_item(ex, TOK, max_length=3)


def test_accuracy_follows_the_loglikelihoods(tiny_llama, tmp_path):
    tasks = {"toy": examples(6)}
    st = store(tmp_path)
    keys = evaluate_mc(tiny_llama, TOK, tasks, {"full": get_policy("full")}, [Budget(ratio=0.5)],
                       "masked", st, batch_size=4, progress=False)
    assert keys == [make_key("mc", "toy", "full", "none", "masked")]  # budget-free: run once
    rec = st.results[keys[0]]
    hits = hits_norm = 0
    for ex in tasks["toy"]:
        item = mc_item(ex, TOK)
        ll = [direct_loglik(tiny_llama, item.context, ch) for ch in item.choices]
        assert rec["examples"][ex.uid]["ll"] == pytest.approx(ll, abs=1e-4)
        hits += max(range(3), key=ll.__getitem__) == ex.gold
        norm = [x / len(c) for x, c in zip(ll, ex.choices)]
        hits_norm += max(range(3), key=norm.__getitem__) == ex.gold
    assert rec["acc"] == pytest.approx(100 * hits / 6)
    assert rec["acc_norm"] == pytest.approx(100 * hits_norm / 6)
    assert rec["complete"] and rec["n"] == 6 and rec["evict_pct"] == 0.0


def test_cache_mode_run_matches_masked_mode(tiny_mistral, tmp_path):
    tasks = {"toy": examples(4)}
    policies = {"snapkv": get_policy("snapkv", window=4)}
    st = store(tmp_path)
    [km] = evaluate_mc(tiny_mistral, TOK, tasks, policies, [Budget(ratio=0.5)], "masked", st,
                       progress=False)
    [kc] = evaluate_mc(tiny_mistral, TOK, tasks, policies, [Budget(ratio=0.5)], "cache", st,
                       progress=False)
    m, c = st.results[km], st.results[kc]
    for uid in m["examples"]:
        assert m["examples"][uid]["ll"] == pytest.approx(c["examples"][uid]["ll"], abs=2e-5)
    assert m["evict_pct"] == pytest.approx(c["evict_pct"]) and m["evict_pct"] > 40


def test_second_run_skips_finished_keys_and_examples(tiny_llama, tmp_path):
    tasks = {"toy": examples(5)}
    policies = {"full": CountingFull()}
    CountingFull.rows = 0
    evaluate_mc(tiny_llama, TOK, tasks, policies, [], "masked", store(tmp_path), progress=False)
    assert CountingFull.rows == 5
    evaluate_mc(tiny_llama, TOK, tasks, policies, [], "masked", store(tmp_path), progress=False)
    assert CountingFull.rows == 5  # nothing rescored: the key is complete on disk
    # an interrupted key: two examples stored, not complete -> only the other three run
    key = make_key("mc", "toy", "full", "none", "masked")
    st = store(tmp_path)
    kept = dict(list(st.results[key]["examples"].items())[:2])
    st.put(key, {}, kept, complete=False)
    CountingFull.rows = 0
    evaluate_mc(tiny_llama, TOK, tasks, policies, [], "masked", store(tmp_path), progress=False)
    assert CountingFull.rows == 3
    assert store(tmp_path).results[key]["n"] == 5
    # a complete key asked for more examples (a larger --limit) scores only the new ones
    CountingFull.rows = 0
    evaluate_mc(tiny_llama, TOK, {"toy": examples(7)}, policies, [], "masked", store(tmp_path),
                progress=False)
    rec = store(tmp_path).results[key]
    assert CountingFull.rows == 2 and rec["complete"] and rec["n"] == 7


def test_interrupted_run_keeps_partial_results(tiny_llama, tmp_path):
    items = tokenize_tasks({"toy": examples(4)}, TOK)["toy"]
    key = make_key("mc", "toy", "boom", "0.5", "masked")
    calls = {"n": 0}

    class Boom(CountingFull):
        def keep(self, prompt, budget):
            if prompt.layer_idx == 0:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise KeyboardInterrupt
            return super().keep(prompt, budget)

    with pytest.raises(KeyboardInterrupt):
        run_items(tiny_llama, items, Boom(), lambda _u: Budget(ratio=0.5), "masked",
                  store(tmp_path), key, mc_summary, batch_size=2, progress=False)
    rec = store(tmp_path).results[key]  # read back from disk
    assert not rec["complete"] and len(rec["examples"]) == 2


def test_store_refuses_results_of_another_model(tmp_path):
    st = store(tmp_path)
    st.put("mc|t|full|none|masked", {}, {}, complete=True)
    with pytest.raises(EvalError, match="another --out"):
        store(tmp_path, model="other")


def test_matched_budgets_pass_each_examples_ratio(tiny_llama, tmp_path):
    torch.manual_seed(5)
    patch(tiny_llama, GateConfig(gamma=0.0))
    tasks = {"toy": examples(6)}
    RecordingSnapKV.calls = []
    st = store(tmp_path)
    keys = evaluate_matched(tiny_llama, TOK, tasks, {"snapkv": RecordingSnapKV(window=2)},
                            get_policy("attention_gate"), "masked", st, batch_size=6,
                            progress=False)
    ref, got = st.results[keys[0]], st.results[keys[1]]
    assert keys[1] == make_key("mc", "toy", "snapkv", "matched-attention_gate", "masked")
    ratios = {uid: 1.0 - r["evict"] for uid, r in ref["examples"].items()}
    assert len(set(ratios.values())) > 1  # the gate evicts differently per example
    for uid, r in got["examples"].items():
        assert r["budget"] == pytest.approx(ratios[uid])
        # kept per head = ceil(n x ratio): the heuristic evicts what the gate did, +- 1 token
        assert abs(r["evict"] - ref["examples"][uid]["evict"]) <= 1.0 / r["n_ctx"] + 1e-9
    called = sorted(ratio for ratio, rows in RecordingSnapKV.calls for _ in range(rows))
    assert called == pytest.approx(sorted(ratios.values()))


@pytest.mark.usefixtures("research_policies")
def test_ranked_gate_runs_at_each_budget_beside_the_thresholded_one(tiny_llama, tmp_path):
    """The thresholded gate runs once (label none); a ranked one (rank=true: gate_hybrid, the
    research policy of experiments/policies) once per budget, evicting what the budget says,
    as a heuristic at the same budgets does."""
    torch.manual_seed(5)
    patch(tiny_llama, GateConfig(gamma=0.0))
    policies = {"gate": get_policy("attention_gate"),
                "ranked": get_policy("gate_hybrid", rank=True),
                "h2o": get_policy("h2o")}
    st = store(tmp_path)
    keys = evaluate_mc(tiny_llama, TOK, {"toy": examples(6)}, policies,
                       [Budget(ratio=0.25), Budget(ratio=0.75)], "masked", st, batch_size=6,
                       progress=False)
    assert [k.split("|")[2:4] for k in keys] == [
        ["gate", "none"], ["ranked", "0.25"], ["ranked", "0.75"], ["h2o", "0.25"], ["h2o", "0.75"]]
    res = {tuple(k.split("|")[2:4]): st.results[k] for k in keys}
    for ratio in ("0.25", "0.75"):
        ranked, h2o = res["ranked", ratio], res["h2o", ratio]
        for uid, r in ranked["examples"].items():
            assert r["evict"] == pytest.approx(h2o["examples"][uid]["evict"])  # same kept counts
    assert res["ranked", "0.25"]["evict_pct"] > res["ranked", "0.75"]["evict_pct"]


def test_nearest_rounding_matches_the_reference_eviction_on_average(tiny_llama, tmp_path):
    """Rounded up, a heuristic's per-example eviction never exceeds the gate's and is lower on
    average; rounded to the nearest token each example is within half a token per head of it,
    and the two runs are kept apart by their labels."""
    torch.manual_seed(5)
    patch(tiny_llama, GateConfig(gamma=0.0))
    st = store(tmp_path)
    gate, h2o = get_policy("attention_gate"), {"h2o": get_policy("h2o")}
    tasks = {"toy": examples(6)}
    up = evaluate_matched(tiny_llama, TOK, tasks, h2o, gate, "masked", st, batch_size=6,
                          progress=False)
    near = evaluate_matched(tiny_llama, TOK, tasks, h2o, gate, "masked", st, batch_size=6,
                            progress=False, rounding="nearest")
    assert near[0] == up[0]  # the gate itself ran once
    assert near[1] == make_key("mc", "toy", "h2o", "matched~attention_gate", "masked") != up[1]
    ref = st.results[up[0]]["examples"]
    gaps = {}
    for key in (up[1], near[1]):
        gaps[key] = {uid: ref[uid]["evict"] - r["evict"]
                     for uid, r in st.results[key]["examples"].items()}
    assert all(g >= -1e-9 for g in gaps[up[1]].values())
    for uid, g in gaps[near[1]].items():
        assert abs(g) <= 0.5 / ref[uid]["n_ctx"] + 1e-9
    assert abs(sum(gaps[near[1]].values())) < sum(gaps[up[1]].values())
    with pytest.raises(PolicyError, match="rounding"):
        evaluate_matched(tiny_llama, TOK, tasks, h2o, gate, "masked", st, rounding="down")


def test_evict_summary_sample_mean_and_token_weighted():
    recs = {"a": {"kept": 1, "total": 4, "evict": 0.75}, "b": {"kept": 6, "total": 12, "evict": 0.5}}
    s = evict_summary(recs)
    assert s["evict_pct"] == pytest.approx(62.5)
    assert s["evict_pct_tokens"] == pytest.approx(100 * (1 - 7 / 16))
    assert math.isnan(evict_summary({})["evict_pct"])


def test_unknown_mode_is_a_clear_error(tiny_llama):
    items = tokenize_tasks({"toy": examples(1)}, TOK)["toy"]
    with pytest.raises(EvalError, match="unknown mode"):
        score_batch(tiny_llama, items, get_policy("full"), [Budget(ratio=0.5)], "paged")
