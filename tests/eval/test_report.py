"""Report outputs: markdown table of complete keys, PNG plots, atomic resumable JSON."""

import json

import pytest
import torch

from kvgate.eval import plots
from kvgate.eval.benchmarks.mc.report import plot_eviction_pattern
from kvgate.eval.errors import EvalError
from kvgate.eval.registry import reports
from kvgate.eval.report import markdown_table, write_outputs
from kvgate.eval.store import ResultStore, budget_label, make_key, split_key
from kvgate.policies import Budget

PNG = b"\x89PNG"


def _mc(acc, evict):
    return {"acc": acc, "acc_norm": acc - 1, "evict_pct": evict, "evict_pct_tokens": evict,
            "n": 10}


def filled_store(tmp_path):
    st = ResultStore(tmp_path, {"model": "m", "checkpoint": None}, flush_s=3600)
    for task in ("rte", "copa"):
        st.put(make_key("mc", task, "full", "none", "masked"), _mc(70, 0),
               {}, complete=True)
        for b, acc in (("0.5", 60.0), ("0.25", 50.0)):
            st.put(make_key("mc", task, "snapkv", b, "masked"),
                   _mc(acc, 100 * (1 - float(b))), {}, complete=True)
    st.put(make_key("mc", "rte", "h2o", "0.5", "masked"), _mc(1, 50), {},
           complete=False)
    for length in (256, 512):
        for depth in (0.0, 50.0):
            st.put(make_key("needle", f"{length}@{depth:g}", "snapkv", "0.5", "rank-masked"),
                   {"length": length, "depth": depth, "acc": 50.0, "n": 2, "evict_pct": 50.0},
                   {}, complete=True)
    return st


def test_keys_and_budget_labels():
    assert budget_label(Budget(ratio=0.5)) == "0.5"
    assert budget_label(Budget(tokens=128)) == "128t"
    assert budget_label(None) == "none"
    key = make_key("mc", "rte", "snapkv", "0.5", "cache")
    assert split_key(key) == {"kind": "mc", "task": "rte", "policy": "snapkv",
                              "budget": "0.5", "mode": "cache"}


def test_markdown_table_lists_complete_keys_only(tmp_path):
    table = markdown_table(filled_store(tmp_path).complete_results(), reports())
    assert "### mc" in table and "### needle" in table
    assert "| rte | snapkv | 0.25 | masked | 10 | 50.00 | 49.00 | 75.00 |" in table
    assert "h2o" not in table  # its key never completed


def test_write_outputs_makes_table_and_plots(tmp_path):
    st = filled_store(tmp_path)
    paths = write_outputs(st, reports())
    names = sorted(p.name for p in paths)
    assert names == ["accuracy_vs_eviction.png", "needle_snapkv_0.5_rank-masked.png",
                     "results.md"]
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:4] == PNG
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["model"] == "m" and len(saved["results"]) == 11


def test_perplexity_results_get_a_ppl_vs_eviction_plot(tmp_path):
    st = ResultStore(tmp_path, {"model": "m", "checkpoint": None}, flush_s=3600)
    st.put(make_key("ppl", "corpus@8+8", "full", "none", "masked"),
           {"ppl": 10.0, "evict_pct": 0.0, "n": 4}, {}, complete=True)
    for b, ppl in (("0.5", 11.0), ("0.3", 14.0)):
        st.put(make_key("ppl", "corpus@8+8", "h2o", b, "masked"),
               {"ppl": ppl, "evict_pct": 100 * (1 - float(b)), "n": 4}, {}, complete=True)
    names = sorted(p.name for p in write_outputs(st, reports()))
    assert names == ["ppl_vs_eviction.png", "results.md"]  # no accuracy plot without mc keys
    assert (tmp_path / "ppl_vs_eviction.png").read_bytes()[:4] == PNG


def test_every_curve_gets_its_own_colour_past_ten_series():
    """A seed sweep (gates x thresholds) easily passes the 10 colours of the default cycle."""
    plt = plots.pyplot()
    for n in (3, 14):
        fig, ax = plt.subplots()
        rows = [{"policy": f"gate {i}", "evict_pct": e, "ppl": 10.0 + i + e / 100}
                for i in range(n) for e in (40.0, 50.0)]
        plots.draw_series(ax, rows + [{"policy": "full", "evict_pct": 0.0, "ppl": 9.0}],
                            "ppl", "t", "perplexity")
        curves = [line for line in ax.lines if line.get_label() != "full"]
        assert len(curves) == n and len({line.get_color() for line in curves}) == n
        plt.close(fig)


def test_eviction_pattern_plot(tmp_path):
    keep = torch.rand(3, 2, 20) > 0.5
    path = plot_eviction_pattern(keep, tmp_path / "p.png", "gate", [f"t{i}" for i in range(20)])
    assert path.read_bytes()[:4] == PNG
    with pytest.raises(EvalError, match="layers, kv_heads, tokens"):
        plot_eviction_pattern(torch.ones(3, 20), tmp_path / "q.png")


def test_unreadable_results_file_is_refused(tmp_path):
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(EvalError, match="not readable JSON"):
        ResultStore(tmp_path, {"model": "m"})


def test_partial_state_is_flushed_on_a_timer_and_on_completion(tmp_path):
    st = ResultStore(tmp_path, {"model": "m", "checkpoint": None}, flush_s=3600)
    key = make_key("mc", "t", "full", "none", "masked")
    st.put(key, {}, {"a": {}}, complete=False)  # the first partial state: written at once
    st.put(key, {}, {"a": {}, "b": {}}, complete=False)  # within flush_s of the last write
    on_disk = json.loads((tmp_path / "results.json").read_text())["results"][key]
    assert list(on_disk["examples"]) == ["a"]
    st.put(key, {}, {"a": {}, "b": {}}, complete=True)
    on_disk = json.loads((tmp_path / "results.json").read_text())["results"][key]
    assert on_disk["complete"] and sorted(on_disk["examples"]) == ["a", "b"]


def _store(tmp_path, model="m"):
    return ResultStore(tmp_path, {"model": model, "checkpoint": None}, flush_s=0.0)


def _on_disk(tmp_path):
    return json.loads((tmp_path / "results.json").read_text())["results"]


def test_two_runs_on_one_folder_keep_each_others_keys(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)  # both open the folder before either writes
    ka, kb = (make_key("ppl", "docs", p, "0.5", "masked") for p in ("h2o", "snapkv"))
    a.put(ka, {"ppl": 7.0}, {}, complete=True)
    b.put(kb, {"ppl": 8.0}, {}, complete=True)  # b never saw ka, yet must not drop it
    assert sorted(_on_disk(tmp_path)) == sorted([ka, kb])
    a.put(make_key("ppl", "docs", "h2o", "0.3", "masked"), {"ppl": 9.0}, {}, complete=True)
    assert len(_on_disk(tmp_path)) == 3
    assert kb in a.results  # a's table is written from the merged view


def test_a_run_owns_the_keys_it_stores_and_takes_the_others_from_the_file(tmp_path):
    key = make_key("mc", "rte", "h2o", "0.5", "masked")
    other = make_key("mc", "rte", "snapkv", "0.5", "masked")
    first = _store(tmp_path)
    first.put(key, {"acc": 60.0}, {"1": {}, "2": {}}, complete=True)
    first.put(other, {}, {"1": {}}, complete=False)
    a = _store(tmp_path)  # loads both keys
    b = _store(tmp_path)
    b.put(other, {"acc": 50.0}, {"1": {}, "2": {}}, complete=True)
    a.put(key, {}, {"1": {}}, complete=False)  # a redoes key on purpose (e.g. a larger --limit)
    on_disk = _on_disk(tmp_path)
    assert not on_disk[key]["complete"]  # a's own key: its copy, even though it is behind
    assert on_disk[other]["complete"]  # a's stale copy of b's key does not overwrite b's
    assert a.results[other]["acc"] == 50.0


def test_a_folder_taken_over_by_another_model_is_refused_at_save(tmp_path):
    st = _store(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(
        {"meta": {"model": "other", "checkpoint": None}, "results": {}}))
    with pytest.raises(EvalError, match="model 'other'"):
        st.put(make_key("ppl", "docs", "h2o", "0.5", "masked"), {}, {}, complete=True)
    assert _on_disk(tmp_path) == {}  # the other model's file is left as it was


def _hammer(folder, name, n):
    st = ResultStore(folder, {"model": "m", "checkpoint": None}, flush_s=0.0)
    for i in range(n):
        st.put(make_key("ppl", "docs", name, f"{i}", "masked"), {"ppl": float(i)}, {},
               complete=True)


def test_concurrent_processes_lose_no_key(tmp_path):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(tmp_path, name, 40)) for name in ("a", "b", "c")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(_on_disk(tmp_path)) == 120
    assert not list(tmp_path.glob(".results.json.*.tmp"))  # no temporary file left behind


def test_a_long_legend_goes_beside_the_plot_not_over_its_curves(tmp_path):
    plt = plots.pyplot()
    for n, outside in ((3, False), (14, True)):
        rows = [{"policy": f"gate {i}", "evict_pct": e, "ppl": 10.0 + i + e / 100}
                for i in range(n) for e in (40.0, 50.0)]
        fig, axes = plt.subplots(1, 1, squeeze=False, figsize=(5.5, 4.2))
        plots.draw_series(axes[0][0], rows, "ppl", "t", "perplexity")
        assert plots.save_figure(plt, fig, axes, tmp_path / f"{n}.png").is_file()
        ax = axes[0][0]
        anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
        assert (anchor.x0 > 1.0) == outside
        assert fig.get_size_inches()[0] == (8.5 if outside else 5.5)


def test_every_curve_gets_its_own_colour_up_to_forty_series():
    plt = plots.pyplot()
    for n in (12, 25):
        rows = [{"policy": f"gate {i:02d}", "evict_pct": e, "ppl": 10.0 + i + e / 100}
                for i in range(n) for e in (40.0, 50.0)]
        fig, axes = plt.subplots(1, 1, squeeze=False)
        plots.draw_series(axes[0][0], rows, "ppl", "t", "perplexity")
        colours = {line.get_color() if isinstance(line.get_color(), str)
                   else tuple(line.get_color()) for line in axes[0][0].get_lines()}
        assert len(colours) == n
        plt.close(fig)
