"""bench/bench_kv_quant.py on a tiny model: one row per storage with its ratios to the 16-bit
cache and the dequantize time it measured, and the key-grouping comparison (its KIVI grouping
checked against a direct per-channel loop)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import build, load_script, tiny_llama_config

from kvgate.cache.quant import dequantize, quantize
from kvgate.eval.benchmarks.ruler.tasks import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from engine_toys import char_tokenizer


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_kv_quant.py")


def test_rows_and_grouping_on_a_tiny_model(bench, capsys):
    model = build(tiny_llama_config(max_position_embeddings=640))
    tok = char_tokenizer()
    args = bench.parse_args(["--length", "300", "--new-tokens", "6", "--answer-tokens", "4",
                             "--repeats", "2", "--bits", "8,4", "--group", "8", "--residual",
                             "4", "--budget", "0.5", "--policy", "snapkv"])
    ex = generate(args.task, tok, args.length, seed=0)
    rows = bench.measure(args, model, tok, ex)
    assert [r["bits"] for r in rows] == [16, 8, 4]  # the reference added, first
    ref, q8, q4 = rows
    assert ref["decode_x16"] == ref["bytes_x16"] == 1.0 and ref["dequant_ms_step"] == 0
    assert ref["same_tokens"] and ref["same_answer"]
    for r in (q8, q4):
        assert r["repeats"] == 2 and r["decode_tps"] > 0 and r["total_s"] > 0
        assert r["dequant_ms_step"] > 0 and 0 < r["dequant_share"] < 1
    assert q4["bytes_held"] < q8["bytes_held"] < 0.6 * ref["bytes_held"]
    bench.print_rows(rows)
    assert capsys.readouterr().out.count("\n") == 4
    grouped = bench.grouping(args, model, tok, ex)
    assert [(g["bits"], g["keys"]) for g in grouped] == [(8, "token"), (8, "channel"),
                                                         (4, "token"), (4, "channel")]
    assert all(g["kl"] >= 0 and 0 <= g["same_argmax"] <= 1 for g in grouped)


def test_kivi_grouping_quantizes_each_channel_over_its_tokens(bench):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 11, 4, generator=g)  # 11 tokens: groups of 4, 4 and a partial 3
    got = bench._per_channel(x, 8, 4)
    for h in range(2):
        for c in range(4):
            for lo in (0, 4, 8):
                part = x[0, h, lo:lo + 4, c]
                want = dequantize(quantize(part[None], 8, part.numel()), x.dtype)[0]
                assert torch.equal(got[0, h, lo:lo + 4, c], want)
