"""Lightning data modules: packed continual pre-training (CPT) and SFT on one task or a mixture.

Both produce the batch contract of ``kvgate.training.module`` (built in
``kvgate.training.batches``) through the shared machinery of ``kvgate.training.datamodule``
(seeded resumable order, loaders, tokenizer lookup); its names, and the batch builders, are
importable from here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial
from itertools import zip_longest
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from kvgate.data.oracle.settings import OracleLabels, oracle_settings
from kvgate.training.batches import (
    TensorRows,
    collate_blocks,
    collate_options,
    collate_sft,
    encode_prompt_answer,
    pack_documents,
)
from kvgate.training.datamodule import KVGateDataModule, ResumableLoader, ResumableSampler
from kvgate.training.errors import TrainingConfigError

__all__ = [
    "CPTDataModule", "CorpusSource", "KVGateDataModule", "ResumableLoader", "ResumableSampler",
    "SFTDataModule", "TensorRows", "collate_blocks", "collate_options", "collate_sft",
    "encode_prompt_answer", "pack_documents", "sft_tasks",
]

CorpusSource = Literal["embedded", "files", "redpajama"]


def sft_tasks(task: str | Sequence[str]) -> tuple[str, ...]:
    """``data.task`` as a tuple of known, distinct task names (one name or a mixture)."""
    from kvgate.data import TASKS

    names = (task,) if isinstance(task, str) else tuple(task)
    if not names:
        raise TrainingConfigError("data.task: give a task or a non-empty list of tasks")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise TrainingConfigError(f"data.task: unknown task(s) {', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(TASKS)}")
    if len(set(names)) != len(names):
        raise TrainingConfigError(f"data.task: a task is listed twice in {list(names)}")
    return names


class CPTDataModule(KVGateDataModule):
    """Continual pre-training on packed fixed-length sequences; loss on every token, or on
    a continuation after a prompt."""

    def __init__(self, source: CorpusSource = "embedded", files: list[str] | None = None,
                 max_docs: int | None = None, seq_len: int = 256, val_fraction: float = 0.02,
                 batch_size: int = 4, val_batch_size: int | None = None, seed: int = 0,
                 num_workers: int = 0, continuation: int = 0,
                 oracle: OracleLabels | None = None) -> None:
        """
        Args:
            source: ``embedded`` (the corpus shipped with kvgate), ``files`` (local .txt /
                .jsonl files) or ``redpajama`` (the RedPajama sample from the hub).
            files: the local files for ``source='files'``.
            max_docs: use at most this many documents (None = all).
            seq_len: tokens per packed training sequence.
            val_fraction: share of the documents held out for validation (0 = none).
            continuation: 0 = loss on every token. Otherwise each block is a prompt (the first
                ``seq_len - continuation`` tokens, ``prompt_mask``) and a scored continuation,
                the way perplexity under eviction is measured: a ``prompt_bidirectional`` gate
                then sees the whole prompt, knows where it ends, and flags prompt tokens only.
            oracle: the KVzip labels of the training blocks (``kvgate data oracle``), over
                each block's prompt (all of it when ``continuation`` is 0). Loaded, and checked
                against this run's base and blocks, when ``model.recipe.oracle_weight > 0``;
                each training batch then carries ``oracle`` [B, L, H_kv, context].
        """
        super().__init__(batch_size, val_batch_size, seed, num_workers)
        if source not in ("embedded", "files", "redpajama"):
            raise TrainingConfigError(
                f"data.source: must be embedded, files or redpajama (got {source!r})")
        if source == "files" and not files:
            raise TrainingConfigError("data.files: source='files' needs at least one file")
        if seq_len < 2:
            raise TrainingConfigError(f"data.seq_len: must be >= 2 (got {seq_len!r})")
        if not 0.0 <= val_fraction < 1.0:
            raise TrainingConfigError(f"data.val_fraction: must lie in [0, 1) (got {val_fraction!r})")
        if not isinstance(continuation, int) or not 0 <= continuation <= seq_len - 2:
            raise TrainingConfigError(
                f"data.continuation: must be an integer in [0, seq_len - 2 = {seq_len - 2}] so "
                f"the prompt keeps at least 2 tokens (got {continuation!r})")
        if max_docs is not None and max_docs < 1:
            raise TrainingConfigError(f"data.max_docs: must be >= 1 or null (got {max_docs!r})")
        self.source = source
        self.files = list(files or [])
        self.max_docs = max_docs
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.continuation = continuation
        self.oracle = oracle_settings(oracle)
        # the base's fingerprint (kvgate.data.oracle.base_fingerprint) when the batches must
        # carry labels: taken from the attached KVGateModule, or set by hand without a Trainer
        self.oracle_base: str | None = None
        self._splits: tuple[Tensor, Tensor] | None = None

    def load_documents(self) -> list[str]:
        from kvgate import data
        from kvgate.data.redpajama import PAPER_SAMPLES

        if self.source == "embedded":
            return data.load_corpus(max_docs=self.max_docs, seed=self.seed)
        if self.source == "files":
            docs = data.load_text_files(self.files)
        else:
            docs = data.load_redpajama_sample(n=self.max_docs or PAPER_SAMPLES,
                                              seed=self.seed)
        return docs[: self.max_docs] if self.max_docs else docs

    def _blocks(self, tokenizer) -> tuple[Tensor, Tensor]:
        if self._splits is None:
            docs = self.load_documents()
            order = list(range(len(docs)))
            random.Random(self.seed).shuffle(order)
            n_val = round(self.val_fraction * len(docs))
            if self.val_fraction > 0 and len(docs) > 1:
                n_val = max(1, n_val)
            # documents (not blocks) are split so no text is in both sets
            val_docs = [docs[i] for i in order[:n_val]]
            train_docs = [docs[i] for i in order[n_val:]]
            self._splits = (self._pack(tokenizer, train_docs), self._pack(tokenizer, val_docs))
        return self._splits

    def _pack(self, tokenizer, docs: list[str]) -> Tensor:
        if not docs:
            return torch.zeros(0, self.seq_len, dtype=torch.long)
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        return pack_documents(ids, self.seq_len, tokenizer.eos_token_id)

    def train_blocks(self) -> Tensor:
        """The training blocks ``[N, seq_len]`` in their fixed order (the sampler shuffles)."""
        return self._blocks(self.get_tokenizer())[0]

    def label_context(self) -> int:
        """Tokens of each block that oracle labels cover: the prompt (the whole block when no
        continuation is split off)."""
        return self.seq_len - self.continuation

    def describe(self) -> dict:
        """What the blocks come from (recorded beside oracle labels, for people)."""
        return {"class": type(self).__name__, "source": self.source, "files": self.files,
                "max_docs": self.max_docs, "seq_len": self.seq_len,
                "val_fraction": self.val_fraction, "seed": self.seed,
                "continuation": self.continuation}

    def wanted_oracle_base(self) -> str | None:
        """The base fingerprint the labels must match when batches carry them, else None."""
        module = self.trainer.lightning_module if self._trainer_attached() else None
        recipe = getattr(module, "recipe_cfg", None)
        if recipe is None:
            return self.oracle_base
        if not recipe.oracle_weight:
            return None
        if getattr(module, "oracle_fingerprint", None) is None:
            raise TrainingConfigError("model.recipe.oracle_weight: the base's fingerprint is "
                                      "not known before the model is built")
        return module.oracle_fingerprint

    def build_train(self, tokenizer) -> Dataset:
        blocks = self._blocks(tokenizer)[0]
        base = self.wanted_oracle_base()
        if base is None:
            return TensorRows(list(blocks))
        if self.oracle is None:
            raise TrainingConfigError("model.recipe.oracle_weight > 0 trains on KVzip labels: "
                                      "set data.init_args.oracle (see kvgate data oracle)")
        from kvgate.data.oracle import block_layout, load_labels

        labels = load_labels(self.oracle, base, block_layout(blocks, self.label_context()))
        return TensorRows(list(zip(blocks, labels)))

    def build_val(self, tokenizer) -> Dataset | None:
        val = self._blocks(tokenizer)[1]
        return TensorRows(list(val)) if len(val) else None

    def collate_train(self, pad_id: int) -> Callable:
        return partial(collate_blocks, continuation=self.continuation)


class SFTDataModule(KVGateDataModule):
    """Supervised fine-tuning on one multiple-choice task or a mixture: prompt = context, answer
    = the gold choice, loss on the answer tokens only; validation accuracy by option scoring."""

    def __init__(self, task: str | list[str] = "rte",
                 max_len: int = 256, limit_train: int | None = None, limit_val: int | None = None,
                 source: Literal["embedded", "hub"] = "embedded", test_fraction: float = 0.3,
                 split_seed: int = 0, answers: Literal["gold", "all"] = "gold",
                 batch_size: int = 4, val_batch_size: int | None = None,
                 seed: int = 0, num_workers: int = 0, num_fewshot: int = 0,
                 fewshot_seed: int = 0) -> None:
        """
        Args:
            task: a multiple-choice task (``kvgate.data.TASKS``), or a list of them to train on
                their mixture (train parts concatenated, then shuffled by the sampler; the
                validation accuracy pools their test parts, interleaved task by task).
            answers: ``gold``: one training row per example, prompt + gold answer. ``all``: a
                row per choice, as option scoring reads them; the distillation covers every
                choice's tokens, the LM loss only the gold one's. ``batch_size`` counts rows.
            max_len: longest prompt + answer in tokens (the prompt is cut from the left).
            limit_train / limit_val: use at most this many examples per task (None = all).
            source: ``embedded`` (the shipped validation split cut into train/test, see
                ``kvgate.data.splits``) or ``hub`` (the real train/validation splits).
            test_fraction / split_seed: how the embedded split is cut (ignored for ``hub``).
            num_fewshot / fewshot_seed: solved examples before each prompt
                (``kvgate.data.fewshot``, as ``python -m kvgate.eval mc --num-fewshot``), drawn
                from the task's train part for both parts, so a gate meets at training the
                prompt lengths a k-shot evaluation gives it; ``max_len`` must leave room.
        """
        super().__init__(batch_size, val_batch_size, seed, num_workers)
        self.tasks = sft_tasks(task)
        if max_len < 2:
            raise TrainingConfigError(f"data.max_len: must be >= 2 (got {max_len!r})")
        for key, value in (("limit_train", limit_train), ("limit_val", limit_val)):
            if value is not None and value < 1:
                raise TrainingConfigError(f"data.{key}: must be >= 1 or null (got {value!r})")
        if source not in ("embedded", "hub"):
            raise TrainingConfigError(f"data.source: must be embedded or hub (got {source!r})")
        if not 0.0 < test_fraction < 1.0:
            raise TrainingConfigError(
                f"data.test_fraction: must lie strictly in (0, 1) (got {test_fraction!r})")
        if answers not in ("gold", "all"):
            raise TrainingConfigError(f"data.answers: must be gold or all (got {answers!r})")
        if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
            raise TrainingConfigError(
                f"data.num_fewshot: must be an integer >= 0 (got {num_fewshot!r})")
        self.num_fewshot = num_fewshot
        self.fewshot_seed = fewshot_seed
        self.answers = answers
        self.source = source
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.max_len = max_len
        self.limit_train = limit_train
        self.limit_val = limit_val

    def examples(self, part: Literal["train", "test"], limit: int | None):
        from kvgate.data import load_sft_split
        from kvgate.data.fewshot import add_fewshot

        cut = {"test_fraction": self.test_fraction, "seed": self.split_seed, "source": self.source}
        per_task = []
        for task in self.tasks:
            whole = load_sft_split(task, part=part, **cut)
            part_examples = whole[:limit] if limit else whole
            if self.num_fewshot:
                # demonstrations only ever come from the train part: the test part's answers
                # stay unseen, and a train example never demonstrates itself
                pool = whole if part == "train" else load_sft_split(task, "train", **cut)
                part_examples = add_fewshot(part_examples, pool, self.num_fewshot,
                                            self.fewshot_seed)
            per_task.append(part_examples)
        if part == "train":  # the sampler shuffles it
            return [ex for examples in per_task for ex in examples]
        # validation is read in order and often cut short (trainer.limit_val_batches):
        # interleaved, any prefix of it covers every task
        return [ex for row in zip_longest(*per_task) for ex in row if ex is not None]

    def build_train(self, tokenizer) -> Dataset:
        rows = []
        for ex in self.examples("train", self.limit_train):
            picked = range(len(ex.choices)) if self.answers == "all" else (ex.gold,)
            rows.extend((*encode_prompt_answer(tokenizer, ex.context, ex.choices[c], self.max_len),
                         c == ex.gold) for c in picked)
        return TensorRows(rows)

    def build_val(self, tokenizer) -> Dataset | None:
        items = []
        for ex in self.examples("test", self.limit_val):
            rows = [encode_prompt_answer(tokenizer, ex.context, c, self.max_len) for c in ex.choices]
            items.append({"rows": rows, "gold": ex.gold})
        return TensorRows(items)

    def collate_train(self, pad_id: int) -> Callable:
        return partial(collate_sft, pad_id=pad_id)

    def collate_val(self, pad_id: int) -> Callable:
        return partial(collate_options, pad_id=pad_id)
