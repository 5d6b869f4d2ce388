"""``--kv-bits`` on the evaluations besides ruler and longbench (tests/eval/test_ruler_kv_bits.py):
the needle (generate, and rank in ``--mode cache``), ppl, mc and matched in ``--mode cache`` end to
end on a tiny model, every cache that scores quantized and the storage stored with each result
(a folder at other bits refused on resume); their masked modes and ``calibrate`` refuse 8 or 4
bits in one line before any model loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import build, patch_evicting, tiny_llama_config
from eval_fakes import CharTokenizer, cli, fake_loader, results

from kvgate.cache.compressed import CompressedCache
from kvgate.cache.quant import KVQuant
from kvgate.eval.benchmarks.ppl.run import evaluate_ppl
from kvgate.eval.errors import EvalError
from kvgate.eval.store import ResultStore
from kvgate.inference import Engine
from kvgate.policies import Budget, get_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer

TEXTS = ["The grass is green. The sky is blue. The sun is yellow. Here we go. Back again.",
         "Rivers run to the sea and the sea never fills. Birds fly south in the autumn.",
         "A pass key is a number; the rest of this line is only filler for the tests."]
# groups of 8 channels, no residual window: every context entry the caches keep is quantized
Q4 = ["--kv-bits", "4", "--kv-group", "8", "--kv-residual", "0"]
Q8 = ["--kv-bits", "8", "--kv-group", "8", "--kv-residual", "0"]


@pytest.fixture(scope="module")
def model():
    return build(tiny_llama_config(max_position_embeddings=640))


@pytest.fixture
def tiny(monkeypatch, model):
    """The eval loader -> the tiny model; records the loads."""
    return fake_loader(monkeypatch, model, CharTokenizer)


@pytest.fixture
def storages(monkeypatch):
    """The storage of every cache that attended, in order."""
    seen = []
    attend = CompressedCache.attend

    def spy(self, *args, **kwargs):
        seen.append(self.kv)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(CompressedCache, "attend", spy)
    return seen


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in TEXTS))
    return str(path)


def _run(capsys, command, out, *argv):
    code, _, err = cli(capsys, "eval", command, "--model", "x", "--out", str(out),
                       "--no-progress", *argv)
    assert code == 0, err
    return results(out)


def _refused(capsys, command, out, *argv) -> str:
    """The one line a run is refused with (exit 2)."""
    code, _, err = cli(capsys, "eval", command, "--model", "x", "--out", str(out), *argv)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _lls(record):
    return [ll for ex in record["examples"].values() for ll in ex["ll"]]


def _resume_refused(capsys, command, out, argv, stored: int, asked: int) -> None:
    """A folder scored at ``stored`` bits, run again at ``asked``: one line naming both, and
    nothing written."""
    before = (out / "results.json").read_text()
    err = _refused(capsys, command, out, *argv)
    assert f"--kv-bits {stored}" in err and f"--kv-bits {asked}" in err
    assert (out / "results.json").read_text() == before


# --------------------------------------------------------------------------------- needle


NEEDLE = ["--lengths", "260", "--depths", "50", "--samples", "2", "--max-new-tokens", "3",
          "--policies", "full,snapkv", "--budgets", "0.5"]


@pytest.mark.parametrize("quant, bits", [(Q4, 4), (Q8, 8)])
def test_needle_generate_answers_over_quantized_caches(capsys, tiny, storages, texts, tmp_path,
                                                       quant, bits):
    out = tmp_path / "n"
    res = _run(capsys, "needle", out, "--text-files", texts, *NEEDLE, "--scoring", "generate",
               *quant)
    assert set(res) == {f"needle|260@50|{p}|generate-cache-agnostic"
                        for p in ("full|none", "snapkv|0.5")}
    for rec in res.values():
        assert rec["complete"] and rec["n"] == 2
        assert {k: rec["settings"][k] for k in ("kv_bits", "kv_group", "kv_residual")} == {
            "kv_bits": bits, "kv_group": 8, "kv_residual": 0}
        assert all("output" in ex for ex in rec["examples"].values())
    # the shared prefill attends at 16 bits; every cache that answered holds the asked storage
    answered = {kv for kv in storages if kv.quantized}
    assert answered == {KVQuant(bits, 8, 0)}
    _resume_refused(capsys, "needle", out, ["--text-files", texts, *NEEDLE, "--scoring",
                                            "generate"], bits, 16)


def test_needle_rank_in_cache_mode_ranks_over_the_quantized_cache(capsys, tiny, texts,
                                                                  tmp_path):
    argv = ["--text-files", texts, *NEEDLE, "--scoring", "rank", "--distractors", "3",
            "--mode", "cache"]
    plain = _run(capsys, "needle", tmp_path / "16", *argv)
    quant = _run(capsys, "needle", tmp_path / "4", *argv, *Q4)
    assert set(plain) == set(quant) == {f"needle|260@50|{p}|rank-cache-agnostic"
                                        for p in ("full|none", "snapkv|0.5")}
    for key in plain:  # one identity apart, and scored over other keys and values
        assert plain[key]["settings"]["kv_bits"] == 16 and quant[key]["settings"]["kv_bits"] == 4
        assert "kv_group" not in plain[key]["settings"]
        assert _lls(plain[key]) != _lls(quant[key])
    _resume_refused(capsys, "needle", tmp_path / "16", [*argv, *Q4], 16, 4)


# ------------------------------------------------------------------------------------ ppl


PPL = ["--max-length", "60", "--policies", "full,snapkv", "--budgets", "0.5", "--mode", "cache"]


def test_ppl_in_cache_mode_at_8_and_4_bits(capsys, tiny, storages, texts, tmp_path):
    """The same texts at 16, 8 and 4 bits: each run's caches at its storage, its records
    carrying it, and perplexities that move away from 16 bits as the bits drop."""
    ppl = {}
    for bits, quant in ((16, []), (8, Q8), (4, Q4)):
        storages.clear()
        res = _run(capsys, "ppl", tmp_path / str(bits), "--text-files", texts, *PPL, *quant)
        assert set(res) == {"ppl|corpus|full|none|cache", "ppl|corpus|snapkv|0.5|cache"}
        assert set(storages) == {KVQuant(bits, 8, 0) if quant else KVQuant()}
        for rec in res.values():
            assert rec["complete"] and rec["n"] == 3 and rec["settings"]["kv_bits"] == bits
        ppl[bits] = {key: rec["ppl"] for key, rec in res.items()}
    for key in ppl[16]:
        assert ppl[4][key] != ppl[16][key]
        assert abs(ppl[8][key] - ppl[16][key]) < abs(ppl[4][key] - ppl[16][key])
    _resume_refused(capsys, "ppl", tmp_path / "8", ["--text-files", texts, *PPL, *Q4], 8, 4)


def test_the_masked_scorer_refuses_a_quantized_storage(model, tmp_path):
    """Past the command line too: masks store nothing, so 4 bits would be silently ignored."""
    st = ResultStore(tmp_path, {"model": "tiny", "checkpoint": None})
    with pytest.raises(EvalError, match="kv_bits 4 stores a real cache's entries"):
        evaluate_ppl(model, CharTokenizer(), TEXTS, {"full": get_policy("full")},
                     [Budget(ratio=0.5)], st, mode="masked", max_length=40, progress=False,
                     kv=KVQuant(4, 8, 0))


# ------------------------------------------------------------------------------ mc, matched


MC = ["--tasks", "copa", "--limit", "2", "--mode", "cache"]


@pytest.mark.parametrize("quant, bits", [(Q4, 4), (Q8, 8)])
def test_mc_in_cache_mode_scores_over_the_quantized_cache(capsys, tiny, storages, tmp_path,
                                                          quant, bits):
    argv = [*MC, "--policies", "full,snapkv", "--budgets", "0.5"]
    plain = _run(capsys, "mc", tmp_path / "16", *argv)
    storages.clear()
    res = _run(capsys, "mc", tmp_path / "q", *argv, *quant)
    assert set(storages) == {KVQuant(bits, 8, 0)}
    assert set(res) == set(plain) == {"mc|copa|full|none|cache", "mc|copa|snapkv|0.5|cache"}
    for key, rec in res.items():
        assert rec["complete"] and rec["settings"]["kv_bits"] == bits
        assert plain[key]["settings"]["kv_bits"] == 16
        assert _lls(rec) != _lls(plain[key])
    _resume_refused(capsys, "mc", tmp_path / "q", argv, bits, 16)


def test_matched_in_cache_mode_at_4_bits(capsys, tiny, storages, tmp_path):
    argv = [*MC, "--reference", "snapkv", "--reference-budget", "0.5", "--policies", "window",
            "--patterns", "0"]
    res = _run(capsys, "matched", tmp_path / "m", *argv, *Q4)
    assert set(res) == {"mc|copa|snapkv|0.5|cache", "mc|copa|window|matched-snapkv@0.5|cache"}
    assert set(storages) == {KVQuant(4, 8, 0)}  # the reference's caches and the others'
    assert all(rec["settings"]["kv_bits"] == 4 for rec in res.values())
    _resume_refused(capsys, "matched", tmp_path / "m", argv, 4, 16)


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("command, argv, where", [
    ("ppl", [], "--mode masked"),
    ("mc", ["--tasks", "copa"], "--mode masked"),
    ("matched", ["--tasks", "copa", "--reference", "snapkv"], "--mode masked"),
    ("needle", ["--scoring", "rank"], "--scoring rank in --mode masked"),
])
def test_masked_modes_refuse_8_or_4_bits_in_one_line(capsys, tiny, tmp_path, command, argv,
                                                     where):
    for bits in ("8", "4"):
        err = _refused(capsys, command, tmp_path / "x", *argv, "--kv-bits", bits)
        assert f"--kv-bits {bits} sets how a real cache stores kept entries, and {where} " \
               "has none" in err and "add --mode cache" in err
    assert tiny == []  # refused before any model loaded


@pytest.mark.parametrize("command, argv", [
    ("ppl", ["--mode", "cache"]),
    ("mc", ["--mode", "cache"]),
    ("needle", ["--scoring", "generate"]),
])
def test_bad_storage_values_are_one_line_in_cache_mode(capsys, tiny, tmp_path, command, argv):
    err = _refused(capsys, command, tmp_path / "x", *argv, "--kv-bits", "2")
    assert "--kv-bits must be 16, 8 or 4, got 2" in err
    err = _refused(capsys, command, tmp_path / "x", *argv, "--kv-bits", "4", "--kv-group", "0")
    assert "--kv-group must be an int >= 1, got 0" in err
    assert tiny == []


# ------------------------------------------------------------------------------ calibrate


def test_calibrate_refuses_other_bits_in_one_line(capsys, tiny, tmp_path):
    for bits in ("8", "4"):
        err = _refused(capsys, "calibrate", tmp_path / "c", "--kv-bits", bits)
        assert f"--kv-bits {bits}: calibrate measures the share a gate evicts" in err
    assert tiny == []


@pytest.mark.parametrize("gate", ["local_gate", "attention_gate"])
def test_what_calibrate_measures_is_the_same_at_any_bits(gate):
    """Why calibrate refuses --kv-bits: a gate chooses at the prefill, over the prompt's own
    keys and values, so the share it evicts at a threshold is the same when the cache stores
    what it keeps in 4 bits."""
    from kvgate.gate import GateConfig, patch

    model = build(tiny_llama_config(max_position_embeddings=640))
    if gate == "local_gate":
        patch_evicting(model)
    else:
        patch(model, GateConfig(gamma=0.0))
    text = " ".join(TEXTS) * 2
    for tau in (0.3, 0.6):
        policy = get_policy(gate, tau=tau)
        kept = {bits: Engine(model, char_tokenizer(), policy, 1.0, kv_bits=bits, kv_group=8,
                             kv_residual=0).compress(text, chat=False)
                for bits in (16, 4)}
        assert kept[4].cache.kv.quantized and not kept[16].cache.kv.quantized
        assert 0.0 < kept[16].kept_fraction < 1.0  # the gate evicts something
        assert kept[4].kept_fraction_per_layer == kept[16].kept_fraction_per_layer
