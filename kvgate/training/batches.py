"""The training batches: packed CPT blocks, SFT prompt + answer rows, and option-scoring rows.

The batch contract of ``kvgate.training.module``: ``input_ids`` [B, n] long,
``attention_mask`` [B, n] long, ``labels`` [B, n] long (-100 = no loss), for CPT with oracle
labels ``oracle`` [B, L, H_kv, context] fp16 (log KVzip scores, ``kvgate.data.oracle``), and for SFT
``prompt_mask`` [B, n] bool (the context tokens) and, when wrong choices are trained through
the distillation, ``distill_mask`` [B, n] bool. SFT validation batches score every option:
each example contributes one row per choice and the batch adds ``example_index`` [M],
``choice_index`` [M] and ``gold`` [E].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from kvgate.training.errors import TrainingConfigError


class TensorRows(Dataset):
    """A list of per-example payloads (dicts of lists/ints), collated later."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, eos_id: int | None) -> Tensor:
    """Concatenate tokenised documents (EOS between them) and cut into blocks.

    Returns [N, seq_len] long; the tail shorter than ``seq_len`` is dropped.
    """
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc)
        if eos_id is not None:
            stream.append(eos_id)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def encode_prompt_answer(tokenizer, context: str, answer: str, max_len: int) -> tuple[list[int], int]:
    """Token ids of ``context + answer`` and the prompt length.

    The two parts are tokenised separately so the boundary is exact (the answer's tokens are
    exactly the loss/scoring positions). A too-long prompt is cut from the left: the end of
    the context, next to the answer, matters most.
    """
    prompt = tokenizer(context, add_special_tokens=True)["input_ids"]
    target = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if not target:
        raise TrainingConfigError(f"answer {answer!r} tokenises to nothing")
    target = target[: max_len - 1]
    prompt = prompt[-(max_len - len(target)):]
    return prompt + target, len(prompt)


def collate_sft(rows: Sequence[tuple], pad_id: int) -> dict[str, Tensor]:
    """Right-pad ``(ids, prompt_len)`` rows into the SFT batch; labels only on answer tokens.

    A row may carry a third item, ``gold``: False marks a wrong choice, whose answer tokens
    get no label (the LM loss must not teach it) but are listed in ``distill_mask``, the
    positions the distillation covers (every row's answer tokens), which is then added.
    """
    n = max(len(row[0]) for row in rows)
    b = len(rows)
    input_ids = torch.full((b, n), pad_id, dtype=torch.long)
    attention = torch.zeros(b, n, dtype=torch.long)
    prompt_mask = torch.zeros(b, n, dtype=torch.bool)
    gold = torch.ones(b, 1, dtype=torch.bool)
    for i, (ids, plen, *is_gold) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        prompt_mask[i, :plen] = True
        gold[i] = bool(is_gold[0]) if is_gold else True
    answer = attention.bool() & ~prompt_mask
    labels = torch.where(answer & gold, input_ids, torch.full_like(input_ids, -100))
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
             "prompt_mask": prompt_mask}
    if not bool(gold.all()):
        batch["distill_mask"] = answer
    return batch


def collate_options(examples: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """One row per (example, choice) for option scoring, plus the index tensors."""
    rows, ex_idx, ch_idx = [], [], []
    for e, ex in enumerate(examples):
        for c, row in enumerate(ex["rows"]):
            rows.append(row)
            ex_idx.append(e)
            ch_idx.append(c)
    batch = collate_sft(rows, pad_id)
    batch["example_index"] = torch.tensor(ex_idx, dtype=torch.long)
    batch["choice_index"] = torch.tensor(ch_idx, dtype=torch.long)
    batch["gold"] = torch.tensor([ex["gold"] for ex in examples], dtype=torch.long)
    return batch


def collate_blocks(rows: Sequence[Tensor | tuple[Tensor, Tensor]],
                   continuation: int = 0) -> dict[str, Tensor]:
    """Packed CPT blocks [seq_len] -> batch with every token labelled, or with
    ``continuation > 0``: the last ``continuation`` tokens labelled and the rest marked as the
    prompt (``prompt_mask``), as a prompt + continuation split at inference. Rows of
    ``(block, oracle labels [L, H_kv, context])`` add ``oracle`` [B, L, H_kv, context]."""
    rows = list(rows)
    extra = {}
    if rows and isinstance(rows[0], tuple):
        rows, labels = zip(*rows)
        extra["oracle"] = torch.stack(list(labels))
    ids = torch.stack(list(rows))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra}
    if not continuation:
        return batch | {"labels": ids.clone()}
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    prompt[:, : ids.shape[1] - continuation] = True
    # the token right after the prompt is predicted from it, so it is labelled too
    return batch | {"labels": ids.masked_fill(prompt, -100), "prompt_mask": prompt}

