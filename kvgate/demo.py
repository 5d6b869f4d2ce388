"""Smoke demo of the base model: one greedy chat answer and perplexity on corpus passages.

``python -m kvgate.demo [--model smollm2-135m] [--max-new-tokens 48] [--docs 8]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from kvgate.models import ModelLoadError, load_base
from kvgate.models.perplexity import SAMPLE_PASSAGES, perplexity

PROMPT = "Explain in two sentences why the sky is blue."


def corpus_passages(max_docs: int) -> tuple[list[str], str]:
    """Passages of the CPT corpus and where they came from (built-in ones if it is missing)."""
    try:
        from kvgate.data.corpus import load_corpus
    except ModuleNotFoundError as err:
        if err.name != "kvgate.data.corpus":
            raise
        return list(SAMPLE_PASSAGES), "built-in sample passages (kvgate.data.corpus missing)"
    return list(load_corpus(max_docs=max_docs)), "CPT corpus"


@torch.no_grad()
def chat_answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer to one user message, formatted with the model's chat template."""
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="alias, local folder or hub id")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--docs", type=int, default=8, help="corpus passages to score")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        model, tokenizer = load_base(args.model)
    except ModelLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"model: {args.model} ({model.config.model_type}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"loaded in {time.perf_counter() - start:.1f} s)")

    print(f"\nuser: {PROMPT}")
    print(f"assistant: {chat_answer(model, tokenizer, PROMPT, args.max_new_tokens).strip()}")

    texts, source = corpus_passages(args.docs)
    ppl = perplexity(model, tokenizer, texts, max_length=512, batch_size=4)
    print(f"\nperplexity on {len(texts)} passages of the {source}: {ppl:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
