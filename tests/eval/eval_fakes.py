"""Shared fakes for the evaluation tests: a character tokenizer and random scoring items."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch

from kvgate.eval.masked import ScoringItem
from kvgate.policies.full import Full
from kvgate.policies.snapkv import SnapKV


class CharTokenizer:
    """One token per character (ids 3..127, inside the tiny models' vocabulary of 128);
    BOS = 1 is added when asked for, EOS = 2, padding = 0."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = [self.bos_token_id] if add_special_tokens else []
        return {"input_ids": ids + [3 + ord(c) % 125 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)


def random_items(count=4, seed=1, choices=3, lo=5, hi=20):
    """Items with contexts of different lengths (so batches are padded) and short choices."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(count):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        ctx = tuple(torch.randint(3, 128, (n,), generator=g).tolist())
        chs = tuple(tuple(torch.randint(3, 128, (int(torch.randint(1, 5, (1,), generator=g)),),
                                        generator=g).tolist()) for _ in range(choices))
        items.append(ScoringItem(f"item{i}", ctx, chs, i % choices, tuple(len(c) for c in chs)))
    return items


def direct_loglik(model, context, choice):
    """Summed log-probability of ``choice`` after ``context`` from one plain forward."""
    ids = torch.tensor([list(context) + list(choice)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    n = len(context)
    return sum(logp[n - 1 + j, t].item() for j, t in enumerate(choice))


class CountingFull(Full):
    """``full`` that counts the prompt rows it was asked about (layer 0 only)."""

    rows: ClassVar[int] = 0

    def keep(self, prompt, budget):
        if prompt.layer_idx == 0:
            CountingFull.rows += prompt.key.shape[0]
        return super().keep(prompt, budget)


class RecordingSnapKV(SnapKV):
    """SnapKV that records (budget ratio, rows) of every layer-0 call."""

    calls: ClassVar[list] = []

    def keep(self, prompt, budget):
        if prompt.layer_idx == 0:
            RecordingSnapKV.calls.append((budget.ratio, prompt.key.shape[0]))
        return super().keep(prompt, budget)


def cli(capsys, *argv):
    """Run ``kvgate ARGV...`` in-process: (exit code, stdout, stderr)."""
    from kvgate.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def results(folder: Path) -> dict:
    """The stored results of an eval ``--out`` folder, by key."""
    return json.loads((Path(folder) / "results.json").read_text())["results"]


def fake_loader(monkeypatch, model, make_tokenizer) -> list:
    """``kvgate eval``'s model loader -> ``model`` and a fresh ``make_tokenizer()`` per load;
    returns the list of configs it was called with."""
    import kvgate.eval.commands

    loads = []

    def load(cfg):
        loads.append(cfg)
        return model, make_tokenizer(), {"model": "tiny", "checkpoint": None}

    monkeypatch.setattr(kvgate.eval.commands, "load_model", load)
    return loads
