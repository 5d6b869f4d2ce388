"""Training throughput, two regimes side by side on the same base and batches, one process.

    python bench/bench_train.py [--steps 4] [--seq-len 512] [--batch 1] [--base smollm2-135m]
    python bench/bench_train.py --pair materialised --seq-len 256 --batch 4

``--pair lora`` (default, issue #4): gates + LoRA vs LoRA only; prints the slowdown
LoRA-only / gates+LoRA (target <= 1.35).
``--pair materialised`` (issue #7): gates-only training with kvgate's gated attention (flash
forward + closed-form chunked gate gradient) vs the same step with the gated softmax
materialised as an n x n matrix and differentiated by autograd (the prototype's way); prints
the speed-up (target >= 2x).

Each timed step is forward + loss + backward + AdamW step of ``KVGateModule.training_step``.
The regimes alternate step by step (A, B, A, B, ...) on the same batches, so drifting load
from other processes on the machine hits both alike. One untimed warm-up step each.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate.gate.apply as gate_apply
from kvgate.attention.gated import gated_attention_reference
from kvgate.training.data import CPTDataModule, collate_blocks
from kvgate.training.module import KVGateModule, causal_lm_loss


def materialised(q, k, v, gate, allowed=None, scaling=None, recent=0, chunk=None):
    """The prototype's gated attention: the n x n gated softmax, autograd backward."""
    return gated_attention_reference(q, k, v, gate, allowed, scaling=scaling, recent=recent)


@contextmanager
def attention_impl(name: str):
    """Route the gated layers through ``name`` ('kvgate' or 'materialised') for a block."""
    if name == "kvgate":
        yield
        return
    saved = gate_apply.gated_attention
    gate_apply.gated_attention = materialised
    try:
        yield
    finally:
        gate_apply.gated_attention = saved


def build(base: str, train: str) -> tuple[KVGateModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = KVGateModule(base_model=base, train=train, image_every_n_steps=0,
                          lora={"rank": 8, "alpha": 16.0, "dropout": 0.0})
    module.configure_model()
    params = [p for _, p in module.trainable_named_parameters()]
    return module, torch.optim.AdamW(params, lr=1e-4)


def step(module: KVGateModule, opt: torch.optim.Optimizer, batch: dict) -> float:
    start = time.perf_counter()
    loss = _loss(module, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _loss(module: KVGateModule, batch: dict) -> torch.Tensor:
    """training_step's loss without its self.log calls (they need a Trainer)."""
    logits = module(batch["input_ids"], batch["attention_mask"])
    loss, _ = causal_lm_loss(logits, batch["labels"])
    if module.gated:
        ev, _ = module.gate_terms(batch)
        loss = loss + ev
    return loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per regime")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pair", choices=["lora", "materialised"], default="lora",
                        help="what the gated run is compared with")
    args = parser.parse_args()

    if args.pair == "lora":
        regimes = {"gates_lora": build(args.base, "gates_lora"), "lora": build(args.base, "lora")}
        impl = {"gates_lora": "kvgate", "lora": "kvgate"}
    else:
        module, opt = build(args.base, "gates")
        # one module, two attention routes: identical weights, so only the kernel differs
        regimes = {"kvgate": (module, opt), "materialised": (module, opt)}
        impl = {"kvgate": "kvgate", "materialised": "materialised"}
    data = CPTDataModule(source="embedded", max_docs=200, seq_len=args.seq_len,
                         batch_size=args.batch, val_fraction=0.0)
    data.tokenizer = next(iter(regimes.values()))[0].tokenizer
    blocks = data.train_dataset()
    n_batches = args.steps + 1
    if len(blocks) < n_batches * args.batch:
        raise SystemExit(f"corpus too small for {n_batches} batches of {args.batch}x{args.seq_len}")
    batches = [collate_blocks([blocks[i * args.batch + j] for j in range(args.batch)])
               for i in range(n_batches)]
    for module, _ in regimes.values():
        module.train()
    seconds = {name: 0.0 for name in regimes}
    for i, batch in enumerate(batches):
        for name, (module, opt) in regimes.items():
            with attention_impl(impl[name]):
                took = step(module, opt, batch)
            if i > 0:  # step 0 warms up allocators and kernels
                seconds[name] += took
    tokens = args.steps * args.batch * args.seq_len
    tps = {name: tokens / s for name, s in seconds.items()}
    print(f"base={args.base} seq_len={args.seq_len} batch={args.batch} timed_steps={args.steps} "
          f"threads={torch.get_num_threads()}")
    for name, value in tps.items():
        print(f"  {name:<11} {value:8.1f} tokens/s  ({seconds[name] / args.steps:.2f} s/step)")
    if args.pair == "lora":
        ratio = tps["lora"] / tps["gates_lora"]
        print(f"slowdown gates+LoRA vs LoRA-only: {ratio:.3f}x (target <= 1.35x)")
    else:
        ratio = tps["kvgate"] / tps["materialised"]
        print(f"speed-up kvgate vs materialised gated attention: {ratio:.3f}x (target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
