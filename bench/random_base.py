"""Write a random-weight model with a real model's architecture and tokenizer.

    python bench/random_base.py SRC DST [--dtype bfloat16]

SRC is a folder with config.json and the tokenizer files (no weights needed). For speed runs on a
machine the real weights cannot reach: the cost of a step does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.src)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dst)
    AutoTokenizer.from_pretrained(args.src).save_pretrained(args.dst)
    print(f"{args.dst}: random {config.model_type}, "
          f"{sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
