"""Passkey prompts (length, depth), needle scoring, greedy generation and perplexity under
eviction."""

import math

import pytest
import torch
from conftest import build, tiny_llama_config
from eval_fakes import CharTokenizer

from kvgate.eval.asked import Question, ask_query_aware
from kvgate.eval.benchmarks.needle.run import (
    INTRO,
    NEEDLE,
    QUESTION,
    SNAP,
    evaluate_needle,
    make_needle,
    needle_set,
    rank_item,
)
from kvgate.eval.benchmarks.ppl.run import evaluate_ppl, ppl_items, ppl_window_items
from kvgate.eval.errors import EvalError
from kvgate.eval.store import ResultStore
from kvgate.policies import Budget, get_policy

TOK = CharTokenizer()
FILLER = ["The grass is green. The sky is blue. The sun is yellow. Here we go. Back again.",
          "Rivers run to the sea and the sea never fills. Birds fly south."] * 4


def _filler(n):
    ids = []
    while len(ids) < n:
        for t in FILLER:
            ids += TOK(" " + t, False)["input_ids"]
    return ids[:n]


@pytest.mark.parametrize("length", [300, 433])
@pytest.mark.parametrize("depth", [0.0, 10.0, 37.0, 50.0, 75.0, 100.0])
def test_needle_lands_at_the_requested_depth_and_length(length, depth):
    ex = make_needle(TOK, _filler(length), length, depth, "12345", "u")
    assert len(ex.ids) == length
    needle = TOK(NEEDLE.format(key="12345"), False)["input_ids"]
    assert list(ex.ids[ex.needle_start: ex.needle_start + len(needle)]) == needle
    question = TOK(QUESTION, False)["input_ids"]
    assert list(ex.ids[-len(question):]) == question
    assert abs(ex.actual_depth - depth) <= 100 * 16 / ex.filler_len + 1e-9  # snapped <= 16 tokens
    # the depth is the share of filler tokens before the needle
    head = len(TOK(INTRO)["input_ids"])
    assert ex.filler_len == length - head - len(needle) - len(question)
    assert ex.actual_depth == pytest.approx(100 * (ex.needle_start - head) / ex.filler_len)
    unsnapped = make_needle(TOK, _filler(length), length, depth, "12345", "u", snap=False)
    cut = round(depth / 100 * ex.filler_len)
    assert unsnapped.actual_depth == pytest.approx(100 * cut / ex.filler_len)
    hay = _filler(ex.filler_len)
    ends = [i for i in range(max(1, cut - SNAP), min(len(hay), cut + SNAP) + 1)
            if TOK.decode([hay[i - 1]]) in ".!?"]
    if 0 < depth < 100 and ends:  # moved onto the nearest sentence end
        assert TOK.decode([ex.ids[ex.needle_start - 1]]) in ".!?"
        assert ex.needle_start - head == min(ends, key=lambda i: abs(i - cut))
    else:
        assert ex.ids == unsnapped.ids


def test_needle_refuses_impossible_requests():
    with pytest.raises(EvalError, match="no room"):
        make_needle(TOK, _filler(50), 50, 50.0, "12345", "u")
    with pytest.raises(EvalError, match="depth"):
        make_needle(TOK, _filler(300), 300, 120.0, "12345", "u")


def test_needle_set_is_deterministic_with_distinct_keys():
    a = needle_set(TOK, FILLER, 300, 50.0, 4, seed=1)
    b = needle_set(TOK, FILLER, 300, 50.0, 4, seed=1)
    assert [x.ids for x in a] == [x.ids for x in b]
    assert len({x.key for x in a}) == 4 and all(len(x.key) == 5 for x in a)
    item = rank_item(a[0], TOK, distractors=5)
    assert len(item.choices) == 6
    assert TOK.decode(item.choices[item.gold]) == " " + a[0].key


def _plain_greedy(model, ids, steps):
    ids = list(ids)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def test_greedy_generation_with_full_cache_equals_plain_decoding(tiny_model):
    for prompt in [list(range(3, 20)), list(range(30, 40))]:
        asked = ask_query_aware(tiny_model, TOK, prompt, Question((), 4), get_policy("full"),
                                Budget(ratio=1.0), ["generate"])
        plain = _plain_greedy(tiny_model, prompt, 4)
        plain = plain[:plain.index(TOK.eos_token_id)] if TOK.eos_token_id in plain else plain
        assert asked.text == TOK.decode(plain)
        assert asked.kept == asked.total == 2 * tiny_model.config.num_key_value_heads * len(prompt)


def test_needle_runs_write_accuracy_cells(tmp_path):
    tiny_llama = build(tiny_llama_config(max_position_embeddings=512))
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    policies = {"full": get_policy("full"), "window": get_policy("window")}
    keys = evaluate_needle(tiny_llama, TOK, FILLER, [260], [0.0, 100.0], policies,
                           [Budget(ratio=0.25)], st, scoring="rank", samples=2, distractors=3,
                           progress=False)
    assert len(keys) == 4
    for key in keys:
        rec = st.results[key]
        assert rec["complete"] and rec["n"] == 2 and 0.0 <= rec["acc"] <= 100.0
        assert rec["length"] == 260 and rec["depth"] in (0.0, 100.0)
    assert st.results["needle|260@0|window|0.25|rank-masked-agnostic"]["evict_pct"] > 70
    gen = evaluate_needle(tiny_llama, TOK, FILLER, [260], [50.0], {"window": policies["window"]},
                          [Budget(ratio=0.5)], st, scoring="generate", samples=2,
                          max_new_tokens=3, progress=False)
    rec = st.results[gen[0]]
    assert gen[0].endswith("generate-cache-agnostic") and rec["n"] == 2
    assert all(r["hit"] == (r["key"] in r["output"]) for r in rec["examples"].values())


def test_perplexity_under_eviction(tiny_llama, tmp_path):
    texts = ["the cat sat on the mat and looked at the door for a long while",
             "a short one", "x"]
    items = ppl_items(TOK, texts, max_length=40, prefix=0.5)
    assert len(items) == 2  # "x" has too few tokens
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    keys = evaluate_ppl(tiny_llama, TOK, texts, {"full": get_policy("full"),
                                                 "h2o": get_policy("h2o")},
                        [Budget(ratio=0.5)], st, mode="masked", max_length=40)
    # full: the plain model's NLL of each text's second half given its first half
    nll = count = 0
    for it in items:
        ids = torch.tensor([list(it.context) + list(it.choices[0])])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_llama(ids).logits[0].double(), -1)
        cut = len(it.context)
        nll -= sum(logp[t - 1, ids[0, t]].item() for t in range(cut, ids.shape[1]))
        count += ids.shape[1] - cut
    full = st.results[keys[0]]
    assert full["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert full["tokens"] == count
    h2o = st.results[keys[1]]
    assert h2o["ppl"] != pytest.approx(full["ppl"], rel=1e-4) and h2o["evict_pct"] > 40
    [cache_key] = evaluate_ppl(tiny_llama, TOK, texts, {"h2o": get_policy("h2o")},
                               [Budget(ratio=0.5)], st, mode="cache", max_length=40)
    assert st.results[cache_key]["ppl"] == pytest.approx(h2o["ppl"], rel=1e-5)


def test_ppl_arguments_are_checked():
    with pytest.raises(EvalError, match="prefix"):
        ppl_items(TOK, ["some text here"], prefix=1.0)
    with pytest.raises(EvalError, match="4 tokens"):
        ppl_items(TOK, ["ab"])


def test_ppl_windows_have_the_exact_context_and_cover_the_stream():
    texts = ["the cat sat on the mat", "and looked at the door", "for a long while then left"]
    items = ppl_window_items(TOK, texts, context=10, continuation=4)
    stream = []
    for t in texts:
        stream += list(TOK(t)["input_ids"]) + ([TOK.eos_token_id] if TOK.eos_token_id is not None
                                               else [])
    assert len(items) == len(stream) // 14
    for i, it in enumerate(items):
        assert len(it.context) == 10 and len(it.choices[0]) == 4
        assert list(it.context) + list(it.choices[0]) == stream[i * 14:(i + 1) * 14]
    assert len(ppl_window_items(TOK, texts, 10, 4, windows=2)) == 2
    with pytest.raises(EvalError, match="too few"):
        ppl_window_items(TOK, texts, 10, 4, windows=1000)
    with pytest.raises(EvalError, match=">= 1"):
        ppl_window_items(TOK, texts, 0, 4)


def test_ppl_window_mode_scores_only_the_continuations(tiny_llama, tmp_path):
    texts = ["the cat sat on the mat and looked at the door for a long while"] * 3
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    [key] = evaluate_ppl(tiny_llama, TOK, texts, {"random": get_policy("random")},
                         [Budget(ratio=0.5)], st, context=12, continuation=6, windows=3)
    rec = st.results[key]
    assert "@12+6" in key and rec["tokens"] == 3 * 6 and rec["n"] == 3
    assert rec["evict_pct"] == pytest.approx(50.0, abs=5)


def test_more_ppl_windows_extend_a_finished_run(tiny_llama, tmp_path):
    """--windows 2 then --windows 4 scores windows 3-4 only and equals a fresh 4-window run."""
    texts = ["the cat sat on the mat and looked at the door for a long while"] * 4
    ext = ResultStore(tmp_path / "ext", {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    fresh = ResultStore(tmp_path / "fresh", {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    pol, bud = {"h2o": get_policy("h2o")}, [Budget(ratio=0.5)]
    [key] = evaluate_ppl(tiny_llama, TOK, texts, pol, bud, ext, context=12, continuation=6,
                         windows=2)
    first = dict(ext.results[key]["examples"])
    evaluate_ppl(tiny_llama, TOK, texts, pol, bud, ext, context=12, continuation=6, windows=4)
    evaluate_ppl(tiny_llama, TOK, texts, pol, bud, fresh, context=12, continuation=6, windows=4)
    got, want = ext.results[key], fresh.results[key]
    assert got["complete"] and got["n"] == 4 and got["tokens"] == 4 * 6
    assert all(got["examples"][uid] == rec for uid, rec in first.items())  # the first two kept
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-6)


def test_needle_question_after_compression_by_default(tmp_path):
    """The default compresses [intro | filler ... needle ...] and asks after; --query-aware
    compresses the question too, under the old keys. With the full cache both see the same
    tokens, so they agree; a policy then keeps shares of different prompts."""
    model = build(tiny_llama_config(max_position_embeddings=512))
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    policies = {"full": get_policy("full"), "snapkv": get_policy("snapkv")}
    args = (model, TOK, FILLER, [260], [50.0], policies, [Budget(ratio=0.25)], st)
    kw = {"scoring": "generate", "samples": 2, "max_new_tokens": 4, "progress": False}
    agnostic = evaluate_needle(*args, **kw)
    aware = evaluate_needle(*args, **kw, query_aware=True)
    assert agnostic == [k + "-agnostic" for k in aware]
    q = len(TOK(QUESTION, False)["input_ids"])
    for a, b in zip(agnostic, aware):
        ra, rb = st.results[a]["examples"], st.results[b]["examples"]
        assert ra.keys() == rb.keys()
        for uid in ra:  # the policy held the context only, then the whole prompt
            assert rb[uid]["total"] - ra[uid]["total"] == 2 * 2 * q
    full_a, full_b = (st.results[k]["examples"] for k in (agnostic[0], aware[0]))
    assert [r["output"] for r in full_a.values()] == [r["output"] for r in full_b.values()]
    ranked = evaluate_needle(*args, scoring="rank", samples=2, distractors=3, progress=False)
    old = evaluate_needle(*args, scoring="rank", samples=2, distractors=3, progress=False,
                          query_aware=True)
    assert ranked[0].endswith("rank-masked-agnostic") and old[0].endswith("rank-masked")
    for a, b in zip(ranked[:1], old[:1]):  # full: the same ranking either way
        ea, eb = st.results[a]["examples"], st.results[b]["examples"]
        assert [r["gold"] for r in ea.values()] == [r["gold"] for r in eb.values()]
        assert st.results[a]["acc"] == st.results[b]["acc"]


def test_ppl_step_scores_the_continuation_while_the_cache_holds_its_capacity(tiny_llama, tmp_path):
    """``step``: the continuation fed a few tokens per forward with an eviction round after
    each. The full cache scores it as one forward does; H2O, which holds its capacity while
    decoding, scores it over fewer entries than when it evicts only after the whole
    continuation, and its cache ends at the capacity the prefill left."""
    from kvgate.eval.multiple_choice import score_continuations
    from kvgate.inference import Engine

    texts = ["the cat sat on the mat and looked at the door for a long while"] * 3
    win = {"context": 12, "continuation": 8, "windows": 3, "mode": "cache"}

    def ppl(policy, step, folder):
        st = ResultStore(tmp_path / folder, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
        [key] = evaluate_ppl(tiny_llama, TOK, texts, {policy: get_policy(policy)},
                             [Budget(ratio=0.5)], st, step=step, **win)
        return st.results[key]

    full = ppl("full", 1, "f1")
    assert full["ppl"] == pytest.approx(ppl("full", None, "f")["ppl"], rel=1e-5)
    stepped, whole = ppl("h2o", 1, "h1"), ppl("h2o", None, "h")
    assert stepped["step"] == 1 and "step" not in whole
    # the records say what the cache holds at the end: everything, or H2O's 6 of 20 positions
    assert full["held_end_pct"] == pytest.approx(100.0)
    assert stepped["held_end_pct"] == pytest.approx(30.0)
    # a one-shot policy keeps the 8 continuation entries beside its 6
    assert ppl("snapkv", 1, "s1")["held_end_pct"] == pytest.approx(70.0)
    assert stepped["ppl"] != pytest.approx(whole["ppl"], rel=1e-4)
    assert ppl("h2o", 3, "h3")["ppl"] != pytest.approx(stepped["ppl"], rel=1e-4)
    ids = list(range(4, 24))
    cache = Engine(tiny_llama, None, get_policy("h2o"), Budget(ratio=0.5)).new_cache()
    score_continuations(tiny_llama, cache, [ids[:12]], [ids[12:]], step=1)
    layers = tiny_llama.config.num_hidden_layers
    assert all(bool((cache.kept_counts(layer) == 6).all()) for layer in range(layers))
    with pytest.raises(EvalError, match="--mode cache"):
        evaluate_ppl(tiny_llama, TOK, texts, {"h2o": get_policy("h2o")}, [Budget(ratio=0.5)],
                     ResultStore(tmp_path / "m", {"model": "tiny"}, flush_s=0.0), step=1,
                     **(win | {"mode": "masked"}))


def test_the_needle_table_carries_the_teacher_and_paired_columns(tmp_path):
    """--score generate,teacher --paired full on generated needles: the table gains the
    greedy-exact score, its agreement with generation and the paired gap, as RULER's does."""
    from kvgate.eval.paired import add_paired
    from kvgate.eval.registry import reports
    from kvgate.eval.report import write_table

    tiny_llama = build(tiny_llama_config(max_position_embeddings=512))
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None}, flush_s=0.0)
    policies = {"full": get_policy("full"), "window": get_policy("window")}
    keys = evaluate_needle(tiny_llama, TOK, FILLER, [260], [50.0], policies,
                           [Budget(ratio=0.5)], st, scoring="generate", samples=2,
                           max_new_tokens=3, progress=False, scores=("generate", "teacher"))
    add_paired(st, keys, "full")
    md = write_table(st, reports()).read_text()
    head = next(line for line in md.splitlines() if line.startswith("| length|depth"))
    assert head.endswith("| greedy-exact % | agree % | vs full (paired) |")
    full_row = next(line for line in md.splitlines() if "| full |" in line)
    assert full_row.endswith("| +0.0 [0.0, 0.0] |")
