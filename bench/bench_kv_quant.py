"""Eviction with quantized kept entries (``kv_bits`` 8 / 4) against the unquantized compressed
cache, side by side in one process: decode tokens/s, compress + answer time, bytes held.

    python bench/bench_kv_quant.py --length 4096 --new-tokens 64 --policy snapkv --budget 0.5 \
        --bits 16,8,4 --repeats 3 [--device cuda --dtype bfloat16] [--grouping] [--json out.json]

Per repeat, every storage runs one after the other in an order that rotates each repeat (a
machine shared with other jobs slows them alike), on the same example, after an untimed
warm-up; the table gives medians and ratios to the 16-bit cache (``x16``), whatever they are.

- decode: ``Engine.generate`` on the context of one ``--task`` example (its raw text, no chat
  template) for ``--new-tokens`` tokens: the decode tokens/s and the prefill time the engine
  reports, the bytes held at the end;
- compress + answer: ``Engine.compress`` of the context, then ``Engine.answer`` of the question
  (``--answer-tokens`` tokens, greedy), as ``bench_long_context.py`` times them;
- ``dequant``: the time spent dequantizing the stored base inside the decode (the quantized
  cache keeps no dequantized copy: every layer-step rebuilds its working K/V from the codes,
  ``kvgate.cache.rows.QuantRows.dense``), per decode step and as a share of the decode time;
- ``same``: whether the decoded tokens (and the answer) equal the 16-bit cache's.

``--grouping`` (a model with real weights: key channels with outliers): the key grouping of
``kvgate.cache.quant`` (per token, groups of ``--group`` channels) against KIVI's (per channel,
groups of ``--group`` tokens), values per token in both, every stored entry quantized (no
residual window): the question and the 16-bit answer are fed over each faked cache in one
forward, and the mean KL divergence of the next-token distributions from the 16-bit cache's
and the share of equal argmax tokens are printed. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Self

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate
from kvgate.cache.fork import fork_cache
from kvgate.cache.quant import dequantize, quantize
from kvgate.cache.rows import PlainRows, QuantRows
from kvgate.eval.benchmarks.ruler.tasks import generate
from kvgate.models.load import sync_device


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=4096, help="context tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--bits", default="16,8,4")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--residual", type=int, default=64)
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--grouping", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.bits = [int(b) for b in args.bits.split(",") if b]
    if 16 not in args.bits:
        args.bits.insert(0, 16)  # the reference of every ratio
    return args


class DequantClock:
    """Wall time inside ``QuantRows.dense`` (synchronised on a GPU), while installed."""

    def __init__(self, device: torch.device) -> None:
        self.seconds, self.calls, self.device = 0.0, 0, device
        self._real = QuantRows.dense

    def __enter__(self) -> Self:
        clock, real = self, self._real

        def dense(rows):
            sync_device(clock.device)
            t0 = time.perf_counter()
            out = real(rows)
            sync_device(clock.device)
            clock.seconds += time.perf_counter() - t0
            clock.calls += 1
            return out

        QuantRows.dense = dense
        return self

    def __exit__(self, *exc) -> None:
        QuantRows.dense = self._real


def run_once(engine, ex, args) -> dict:
    device = engine.device
    with DequantClock(device) as clock:
        gen = engine.generate([ex.context], max_new_tokens=args.new_tokens)
    stats = gen.stats
    sync_device(device)
    t0 = time.perf_counter()
    compressed = engine.compress([ex.context], chat=False)
    t1 = time.perf_counter()
    answer = engine.answer(compressed, [ex.question], max_new_tokens=args.answer_tokens,
                           answer_prefix=ex.answer_prefix)[0]
    t2 = time.perf_counter()
    steps = max(stats.new_tokens - 1, 1)  # the first new token comes from the prefill
    decode_s = steps / stats.decode_tokens_per_s if stats.decode_tokens_per_s else float("nan")
    return {"decode_tps": stats.decode_tokens_per_s, "prefill_ms": stats.prefill_ms,
            "new_tokens": stats.new_tokens, "bytes_held": stats.bytes_held,
            "bytes_full": stats.bytes_full, "dequant_ms_step": 1000 * clock.seconds / steps,
            "dequant_share": clock.seconds / decode_s, "compress_s": t1 - t0,
            "answer_s": t2 - t1, "total_s": t2 - t0, "tokens": gen.token_ids[0],
            "answer": answer}


def measure(args, model, tok, ex) -> list[dict]:
    engines = {b: kvgate.Engine(model, tok, args.policy, args.budget, kv_bits=b,
                                kv_group=args.group, kv_residual=args.residual)
               for b in args.bits}
    for engine in engines.values():  # warm-up, untimed
        engine.generate([ex.context], max_new_tokens=2)
    runs: dict[int, list[dict]] = {b: [] for b in args.bits}
    for r in range(args.repeats):
        k = r % len(args.bits)
        for b in args.bits[k:] + args.bits[:k]:  # rotate: side by side, fair order
            runs[b].append(run_once(engines[b], ex, args))
    ref = runs[16][-1]

    def med(b, key):
        return statistics.median(run[key] for run in runs[b])

    rows = []
    for b in args.bits:
        last = runs[b][-1]
        row = {"bits": b, "repeats": args.repeats, "new_tokens": last["new_tokens"],
               **{key: med(b, key) for key in ("decode_tps", "prefill_ms", "compress_s",
                                               "answer_s", "total_s", "dequant_ms_step",
                                               "dequant_share")},
               "bytes_held": last["bytes_held"], "bytes_full": last["bytes_full"],
               "same_tokens": last["tokens"] == ref["tokens"],
               "same_answer": last["answer"] == ref["answer"], "answer": last["answer"]}
        row["decode_x16"] = row["decode_tps"] / med(16, "decode_tps")
        row["total_x16"] = row["total_s"] / med(16, "total_s")
        row["bytes_x16"] = row["bytes_held"] / ref["bytes_held"]
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'bits':>4} | {'decode tok/s':>12} | {'x16':>5} | {'dequant ms/step':>15} | "
          f"{'share':>5} | {'compress s':>10} | {'answer s':>8} | {'total s':>7} | {'x16':>5} | "
          f"{'bytes held':>11} | {'x16':>5} | same tokens / answer")
    for r in rows:
        print(f"{r['bits']:>4} | {r['decode_tps']:>12.1f} | {r['decode_x16']:>5.2f} | "
              f"{r['dequant_ms_step']:>15.2f} | {r['dequant_share']:>5.2f} | "
              f"{r['compress_s']:>10.3f} | {r['answer_s']:>8.3f} | {r['total_s']:>7.3f} | "
              f"{r['total_x16']:>5.2f} | {r['bytes_held']:>11,} | {r['bytes_x16']:>5.2f} | "
              f"{r['same_tokens']} / {r['same_answer']}", flush=True)


# ----------------------------------------------------------------------------- --grouping


def _per_token(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Rows [..., d] quantized in groups of channels, back in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    return dequantize(quantize(flat, bits, group), x.dtype).view_as(x)


def _per_channel(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[B, H, T, d] quantized per channel in groups of ``group`` consecutive slots (KIVI's
    keys); a last partial group is padded with its last slot (its range unchanged)."""
    b, h, t, d = x.shape
    pad = -t % group
    xt = torch.cat([x, x[:, :, -1:].expand(b, h, pad, d)], 2) if pad else x
    rows = xt.transpose(2, 3).reshape(-1, group)  # [B * H * d * T / group, group]
    back = dequantize(quantize(rows, bits, group), x.dtype)
    return back.view(b, h, d, t + pad).transpose(2, 3)[:, :, :t]


def _faked(cache, keys_by: str, bits: int, group: int):
    """A fork of ``cache`` whose stored K/V are replaced by their quantize-dequantize round
    trip: keys per token or per channel, values per token."""
    twin = fork_cache(cache)
    for layer in twin.layers:
        store = layer.store.fork()
        if not store.uniform or store.tail_len:
            raise SystemExit("--grouping needs a policy that keeps as many entries per head "
                             "(snapkv, full, ...)")
        k, v = store.base_kv()
        k = _per_token(k, bits, group) if keys_by == "token" else _per_channel(k, bits, group)
        store.rows = PlainRows(k.reshape(-1, k.shape[-1]).contiguous(),
                               _per_token(v, bits, group).reshape(-1, v.shape[-1]))
        layer.store = store
    return twin


@torch.no_grad()
def grouping(args, model, tok, ex) -> list[dict]:
    engine = kvgate.Engine(model, tok, args.policy, args.budget)
    compressed = engine.compress([ex.context], chat=False)
    answer = engine.answer(compressed, [ex.question], max_new_tokens=args.answer_tokens,
                           answer_prefix=ex.answer_prefix)[0]
    from kvgate.inference.compress import _question_text

    text = _question_text(compressed, ex.question, ex.answer_prefix) + answer
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=engine.device)
    start = compressed.attention_mask.sum(-1, keepdim=True)
    positions = start + torch.arange(ids.shape[1], device=ids.device)
    mask = torch.cat([compressed.attention_mask, torch.ones_like(ids)], dim=1)

    def logits(cache):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        return out.logits[0].float().log_softmax(-1)

    exact = logits(fork_cache(compressed.cache))
    rows = []
    print(f"{'bits':>4} | {'keys grouped':<24} | {'KL to 16-bit':>12} | {'same argmax':>11}")
    for bits in (b for b in args.bits if b < 16):
        for keys_by, label in (("token", "per token (kvgate)"),
                               ("channel", "per channel (KIVI)")):
            got = logits(_faked(compressed.cache, keys_by, bits, args.group))
            kl = float((exact.exp() * (exact - got)).sum(-1).mean())
            same = float((exact.argmax(-1) == got.argmax(-1)).float().mean())
            rows.append({"bits": bits, "keys": keys_by, "kl": kl, "same_argmax": same,
                         "rows": ids.shape[1]})
            print(f"{bits:>4} | {label:<24} | {kl:>12.2e} | {same:>11.3f}", flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvgate.load_base(args.base, dtype=args.dtype, device=args.device)
    ex = generate(args.task, tok, args.length, seed=0)
    print(f"{args.base} ({args.dtype}, {args.device}), {args.task} at {args.length} tokens, "
          f"{args.policy} at {args.budget}, {args.new_tokens} decoded / {args.answer_tokens} "
          f"answered, groups of {args.group}, residual {args.residual}, repeats "
          f"{args.repeats} (median), torch threads {torch.get_num_threads()}")
    result = {"args": vars(args), "rows": measure(args, model, tok, ex)}
    print_rows(result["rows"])
    if args.grouping:
        result["grouping"] = grouping(args, model, tok, ex)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
