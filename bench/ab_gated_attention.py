"""Training step time of kvgate's gated attention against its version at another git revision.

    python bench/ab_gated_attention.py --against REV [--train gates] [--seq-len 1024] [--steps 2]

Loads ``kvgate/attention/gated.py`` as it was at REV (``git show``) next to the current one and
times ``KVGateModule`` steps (forward + loss + backward + AdamW) on one module, the two kernels
alternating step by step on the same batches. Prints seconds per step and previous / current.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import bench_train as bt

import kvgate.gate.apply as gate_apply
from kvgate.training.data import CPTDataModule, collate_blocks


def kernel_at(rev: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kvgate/attention/gated.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "gated_previous.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("gated_previous", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    previous = module.gated_attention

    def kernel(*args, prompt=None, **kwargs):
        # revisions before the one-shot prompt mask take no ``prompt``; the A/B trains with
        # the default eq. 5 gate, so it is always None here
        if prompt is not None:
            raise ValueError("the A/B compares eq. 5 kernels (gate.prefill 'gated')")
        return previous(*args, **kwargs)

    return kernel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="git revision of the previous kernel")
    p.add_argument("--base", default="smollm2-135m")
    p.add_argument("--train", default="gates", choices=["gates", "gates_lora"])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="timed steps per kernel")
    args = p.parse_args()
    kernels = {"current": gate_apply.gated_attention, "previous": kernel_at(args.against)}
    module, opt = bt.build(args.base, args.train)
    data = CPTDataModule(source="embedded", max_docs=200, seq_len=args.seq_len, batch_size=1,
                         val_fraction=0.0)
    data.tokenizer = module.tokenizer
    blocks = data.train_dataset()
    module.train()
    seconds = dict.fromkeys(kernels, 0.0)
    for i in range(args.steps + 1):  # step 0 of each warms up
        batch = collate_blocks([blocks[i]])
        for name, kernel in kernels.items():
            gate_apply.gated_attention = kernel
            took = bt.step(module, opt, batch)
            if i:
                seconds[name] += took
    per = {name: s / args.steps for name, s in seconds.items()}
    print(f"{args.train} 1 x {args.seq_len}: current {per['current']:.2f} s/step, previous "
          f"({args.against}) {per['previous']:.2f} s/step, previous / current "
          f"{per['previous'] / per['current']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
