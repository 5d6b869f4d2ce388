"""LM loss of the base model (no gates, no LoRA) on the CPT demo configs' validation batches,
the reference for the val/lm_loss the gated runs log.

    python experiments/base_val_loss.py [--max-docs 200 --seq-len 128 --batches 2]
"""

from __future__ import annotations

import argparse

import torch

from kvgate.training.data import CPTDataModule
from kvgate.training.module import KVGateModule, causal_lm_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-docs", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--batches", type=int, default=2, help="limit_val_batches of the config")
    args = ap.parse_args()
    module = KVGateModule(base_model=args.model, train="lora")  # LoRA B = 0: exactly the base
    module.configure_model()
    module.eval()
    data = CPTDataModule(source="embedded", max_docs=args.max_docs, seq_len=args.seq_len,
                         val_fraction=0.05, batch_size=args.batch_size,
                         val_batch_size=args.batch_size, seed=0)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i >= args.batches:
                break
            logits = module(batch["input_ids"], batch["attention_mask"])
            losses.append(float(causal_lm_loss(logits, batch["labels"])[0]))
    print(f"base val lm loss over {len(losses)} batches: {sum(losses) / len(losses):.4f}")


if __name__ == "__main__":
    main()
