"""CPU time of one decode step over each policy's compressed cache, on a machine others share.

    python experiments/decode_steps.py --length 2048 \
        --policies full,snapkv,local_gate,local_gate:interval=1 [--steps 32] [--rounds 3]

Where ``bench/bench_long_context.py`` times compress + answer by the wall clock (the issue's
ratios, on a free machine), this reads only the decode steps and by the process's CPU time
(``time.process_time``), so that other jobs on the machine slow it less: each policy compresses
one ``niah_single_1`` context of ``--length`` tokens once (budget 0.5; the gated policies on
``--checkpoint``), then, per round, a fork of its cache takes the question and ``--steps``
teacher-forced tokens (the same for every policy, whatever it would generate), the policies
one after the other; each policy's time is its fastest round, per step, on one thread. A spec
``name:key=value;key=value`` gives the policy options (integers). Prints the bytes held right
after compression, the page sizes of the layers' stores (``kvgate.cache.ragged``), ms per step
and the ratios to ``full`` and ``snapkv`` when they run. Not a test; the timings are for
finding where time goes, the issue's numbers come from ``bench_long_context.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate
from kvgate.cache.fork import fork_cache, grow_capacity
from kvgate.eval.benchmarks.ruler.tasks import generate
from kvgate.policies import policy_class


def parse_spec(spec: str) -> tuple[str, dict[str, int]]:
    name, _, options = spec.partition(":")
    pairs = (part.split("=") for part in options.split(";") if part)
    return name, {key: int(value) for key, value in pairs}


def step_ms(model, compressed, question: torch.Tensor, feed: torch.Tensor) -> float:
    """CPU ms per step of ``feed`` teacher-forced tokens after ``question``, on a fork."""
    cache = fork_cache(compressed.cache)
    n = int(compressed.attention_mask.sum())
    grow_capacity(cache, torch.tensor([question.shape[1]]))
    with torch.no_grad():
        model(input_ids=question, position_ids=torch.arange(n, n + question.shape[1])[None],
              past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = n + question.shape[1]
        t0 = time.process_time()
        for i in range(feed.shape[0]):  # a loop over decode steps
            model(input_ids=feed[i].view(1, 1), position_ids=torch.tensor([[start + i]]),
                  past_key_values=cache, use_cache=True)
        return (time.process_time() - t0) / feed.shape[0] * 1e3


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--policies", default="full,snapkv,local_gate")
    ap.add_argument("--checkpoint", default="runs/cpt_kvzap/gated")
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    specs = [s for s in args.policies.split(",") if s]
    gated = tok = base = None
    if any(policy_class(parse_spec(s)[0]).needs_gate for s in specs):
        gated, tok, _ = kvgate.load_gated(args.checkpoint)
    if any(not policy_class(parse_spec(s)[0]).needs_gate for s in specs):
        base, tok = kvgate.load_base(args.base)
    ex = generate("niah_single_1", tok, args.length, seed=0)
    question = torch.tensor([tok(ex.question, add_special_tokens=False)["input_ids"]])
    feed = torch.randint(100, 10000, (args.steps,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for spec in specs:
        name, options = parse_spec(spec)
        model = gated if policy_class(name).needs_gate else base
        engine = kvgate.Engine(model, tok, kvgate.get_policy(name, **options), 0.5)
        compressed = engine.compress([ex.context])
        pages = sorted({layer.store.page for layer in compressed.cache.layers})
        print(f"{spec}: kept {compressed.kept_fraction:.3f}, bytes held "
              f"{compressed.bytes_held:,} ({compressed.bytes_held / compressed.cache.full_bytes():.3f}"
              f" of dense), page sizes {pages}", flush=True)
        runs[spec] = (model, compressed)
        step_ms(model, compressed, question, feed[:2])  # warm-up
    best = dict.fromkeys(specs, float("inf"))
    for _ in range(args.rounds):  # the policies one after the other, each round
        for spec, (model, compressed) in runs.items():
            best[spec] = min(best[spec], step_ms(model, compressed, question, feed))
    for spec, ms in best.items():
        ratios = "".join(f", {ms / best[ref]:.2f}x {ref}" for ref in ("full", "snapkv")
                         if ref in best)
        print(f"{spec}: {ms:.1f} ms a step{ratios}")
    return best


if __name__ == "__main__":
    main()
