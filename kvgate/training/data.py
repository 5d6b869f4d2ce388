"""Lightning data modules: packed continual pre-training (CPT) and SFT on one task or a mixture.

Both produce the batch contract of ``kvgate.training.module``:
``input_ids`` [B, n] long, ``attention_mask`` [B, n] long, ``labels`` [B, n] long
(-100 = no loss), and for SFT ``prompt_mask`` [B, n] bool (the context tokens). SFT
validation batches score every option: each example contributes one row per choice and the
batch adds ``example_index`` [M], ``choice_index`` [M] and ``gold`` [E].

Data position: the training order is a seeded permutation per epoch (``ResumableSampler``),
and the data module counts the batches the model has consumed in its ``state_dict``, which
Lightning stores in every checkpoint. On ``--ckpt_path last`` the sampler skips exactly those
batches, so a resumed run sees the same sequence of batches as an uninterrupted one.

The tokenizer comes from the model (``KVGateModule.get_tokenizer``: the one ``configure_model``
loaded, or the tokenizer alone when a strategy asks for the loaders first, as DeepSpeed does):
datasets are built lazily in ``train_dataloader``/``val_dataloader``. Outside a Trainer, set
``datamodule.tokenizer`` yourself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import zip_longest
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from kvgate.training.errors import TrainingConfigError

CorpusSource = Literal["embedded", "files", "redpajama"]


# --------------------------------------------------------------------------- sampling
class ResumableSampler(DistributedSampler):
    """A seeded, epoch-dependent permutation sharded over ranks that can skip the first
    ``k`` samples of one epoch (the part of it a checkpoint already consumed).

    Subclassing ``DistributedSampler`` keeps Lightning from replacing it under DDP; rank and
    world size are passed explicitly so it also works without a process group.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
        self._skip_epoch: int | None = None
        self._skip = 0

    def skip(self, epoch: int, samples: int) -> None:
        """Skip the first ``samples`` indices of this rank's order in ``epoch`` (once)."""
        self._skip_epoch, self._skip = epoch, max(0, samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self._skip_epoch == self.epoch:
            indices = indices[self._skip:]
            self._skip_epoch, self._skip = None, 0
        yield from indices


class ResumableLoader(DataLoader):
    """A DataLoader that reports its data module's position to Lightning's loop state
    (so Lightning knows the loader is resumable) and restores it the same way."""

    def __init__(self, *args, datamodule: KVGateDataModule, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._datamodule = datamodule

    def state_dict(self) -> dict[str, Any]:
        return self._datamodule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # idempotent with the data module's own restore: both set the same skip
        self._datamodule.load_state_dict(state)
        self._datamodule.apply_resume()


# --------------------------------------------------------------------------- datasets
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


def collate_blocks(rows: Sequence[Tensor], continuation: int = 0) -> dict[str, Tensor]:
    """Packed CPT blocks [seq_len] -> batch with every token labelled, or with
    ``continuation > 0``: the last ``continuation`` tokens labelled and the rest marked as the
    prompt (``prompt_mask``), as a prompt + continuation split at inference."""
    ids = torch.stack(list(rows))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if not continuation:
        return batch | {"labels": ids.clone()}
    prompt = torch.zeros_like(ids, dtype=torch.bool)
    prompt[:, : ids.shape[1] - continuation] = True
    # the token right after the prompt is predicted from it, so it is labelled too
    return batch | {"labels": ids.masked_fill(prompt, -100), "prompt_mask": prompt}


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


# --------------------------------------------------------------------------- modules
class KVGateDataModule(L.LightningDataModule):
    """Shared machinery: tokenizer lookup, seeded resumable order, loaders, data position."""

    def __init__(self, batch_size: int = 4, val_batch_size: int | None = None, seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise TrainingConfigError(f"data.batch_size: must be a positive integer (got {batch_size!r})")
        if val_batch_size is not None and val_batch_size < 1:
            raise TrainingConfigError(f"data.val_batch_size: must be >= 1 (got {val_batch_size!r})")
        if num_workers < 0:
            raise TrainingConfigError(f"data.num_workers: must be >= 0 (got {num_workers!r})")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = None  # set by hand, or taken from the attached LightningModule
        self._train: Dataset | None = None
        self._val: Dataset | None = None
        self._sampler: ResumableSampler | None = None
        # data position: batches of the current epoch the model has consumed
        self._pos_epoch = 0
        self._pos_batches = 0
        self._resume: tuple[int, int] | None = None

    # -- subclasses build these from token ids
    def build_train(self, tokenizer) -> Dataset:
        raise NotImplementedError

    def build_val(self, tokenizer) -> Dataset | None:
        return None

    def collate_train(self, pad_id: int) -> Callable:
        """A picklable collate function for training batches (workers may pickle it)."""
        raise NotImplementedError

    def collate_val(self, pad_id: int) -> Callable:
        return self.collate_train(pad_id)

    # -- tokenizer
    def get_tokenizer(self):
        if self.tokenizer is not None:
            return self.tokenizer
        module = self.trainer.lightning_module if self._trainer_attached() else None
        tok = module.get_tokenizer() if hasattr(module, "get_tokenizer") else None
        if tok is None:
            raise TrainingConfigError(
                "data: no tokenizer: attach the data module to a Trainer whose model is built, "
                "or set datamodule.tokenizer")
        return tok

    def _trainer_attached(self) -> bool:
        return getattr(self, "trainer", None) is not None

    def pad_id(self) -> int:
        tok = self.get_tokenizer()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return 0 if pad is None else int(pad)

    # -- loaders
    def train_dataset(self) -> Dataset:
        if self._train is None:
            self._train = self.build_train(self.get_tokenizer())
            if len(self._train) == 0:
                raise TrainingConfigError("data: the training set is empty after tokenisation")
        return self._train

    def val_dataset(self) -> Dataset | None:
        if self._val is None:
            self._val = self.build_val(self.get_tokenizer())
        return self._val

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        world, rank = (self.trainer.world_size, self.trainer.global_rank) \
            if self._trainer_attached() else (1, 0)
        self._sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=self.seed)
        self.apply_resume()
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=self._sampler,
                               collate_fn=self.collate_train(self.pad_id()),
                               num_workers=self.num_workers, datamodule=self)

    def apply_resume(self) -> None:
        """Make the sampler skip the batches a restored checkpoint already consumed."""
        if self._resume is not None and self._sampler is not None:
            epoch, batches = self._resume
            self._sampler.skip(epoch, batches * self.batch_size)
            self._resume = None

    def val_dataloader(self):
        dataset = self.val_dataset()
        if dataset is None or len(dataset) == 0:
            return []
        return DataLoader(dataset, batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=self.collate_val(self.pad_id()),
                          num_workers=self.num_workers)

    # -- data position
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # runs once per batch right before the training step (after any prefetching), so the
        # count equals the batches the model has consumed when a checkpoint is written
        if self._trainer_attached() and self.trainer.training:
            epoch = self.trainer.current_epoch
            if epoch != self._pos_epoch:
                self._pos_epoch, self._pos_batches = epoch, 0
            self._pos_batches += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._pos_epoch, "batches": self._pos_batches, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise TrainingConfigError(
                f"data.seed: the checkpoint's data order used seed {state['seed']}, this run "
                f"has {self.seed}; resume with the same seed")
        self._pos_epoch, self._pos_batches = int(state["epoch"]), int(state["batches"])
        self._resume = (self._pos_epoch, self._pos_batches)


class CPTDataModule(KVGateDataModule):
    """Continual pre-training on packed fixed-length sequences; loss on every token, or on
    a continuation after a prompt."""

    def __init__(self, source: CorpusSource = "embedded", files: list[str] | None = None,
                 max_docs: int | None = None, seq_len: int = 256, val_fraction: float = 0.02,
                 batch_size: int = 4, val_batch_size: int | None = None, seed: int = 0,
                 num_workers: int = 0, continuation: int = 0) -> None:
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

    def build_train(self, tokenizer) -> Dataset:
        return TensorRows(list(self._blocks(tokenizer)[0]))

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
