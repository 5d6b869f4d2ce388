"""Oracle labels of training blocks: the ``kvzip`` policy's own scores, read before its choice.

Each block is a context of its own: prefilled into a ``CompressedCache`` under the ``kvzip``
policy, whose repeat passes then run as at inference (``kvgate.inference.compress.run_passes``,
KVzip arXiv:2505.23416; KVzip+ arXiv:2601.07891); the running scores are read before any entry
is evicted (``kvgate.cache.passes.running_scores``). No second KVzip lives here: what a label
says is exactly what the policy would rank.

One block per forward, in order: a block's labels never depend on which blocks share its
batch or which process computes them, so a resumed run, and a run over N processes, write what
one unbroken process does.

The run is Lightning's predict loop (``label_data(..., trainer=...)``): with one device it runs
in this process; under DDP (``devices`` > 1 or several nodes, e.g. ``--devices 2`` on the CPU
with gloo) each rank takes every N-th missing shard and writes it into the shared folder, and
rank 0 merges the ranks' records into one manifest at the end (``LabelStore.merge``).

Progress is one display (``kvgate.progress``), drawn by rank 0 alone: blocks done of all
blocks, counted after each of its shards from every rank's progress file
(``LabelStore.recorded_blocks``), so that under DDP it shows the whole job, not rank 0's share.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import Tensor

from kvgate.data.oracle.settings import OracleLabels
from kvgate.data.oracle.store import LOG_FLOOR, LabelStore
from kvgate.progress import Progress


@torch.no_grad()
def block_scores(model: Any, tokenizer: Any, ids: Tensor, settings: OracleLabels) -> Tensor:
    """KVzip scores of unpadded contexts ``ids`` [B, n]: ``[B, L, H_kv, n]`` fp32."""
    from kvgate.cache import CompressedCache
    from kvgate.cache.passes import running_scores
    from kvgate.inference.compress import run_passes
    from kvgate.inference.decode import left_padded_positions

    mask = torch.ones_like(ids)
    cache = CompressedCache(model, settings.policy(), 1.0)
    model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    run_passes(model, tokenizer, cache, ids, mask, chat=settings.chat, choose=False)
    # no padding: slot t is token t
    return running_scores(cache).transpose(0, 1)


def log_scores(scores: Tensor) -> Tensor:
    """What is stored: ``log(score)``, floored at ``LOG_FLOOR`` (a 0 would be -inf)."""
    return scores.clamp(min=1e-30).log().clamp(min=LOG_FLOOR)


def shard_labels(model: Any, tokenizer: Any, blocks: Tensor, settings: OracleLabels,
                 context: int) -> Tensor:
    """``[k, L, H_kv, context]`` log scores of ``blocks`` [k, seq_len], one forward a block."""
    device = next(model.parameters()).device
    return torch.stack([log_scores(block_scores(model, tokenizer, row[None, :context].to(device),
                                                settings))[0].cpu()
                        for row in blocks])  # a loop over blocks: one forward each


class Labeller(L.LightningModule):
    """Lightning's view of a labelling run: each predict item is one shard index of this rank
    (-1: nothing, so that every rank runs as many steps and meets the barriers). ``say``: the
    run's lines (what was found done, damaged shards); ``quiet``: no progress display."""

    def __init__(self, model: Any, tokenizer: Any, blocks: Tensor, settings: OracleLabels,
                 identity: dict[str, Any], say: Callable[[str], None],
                 quiet: bool = False) -> None:
        super().__init__()
        self.base = model  # a submodule, so Lightning moves it to each rank's device
        self.tokenizer, self.blocks, self.settings = tokenizer, blocks, settings
        self.identity, self.say, self.quiet = identity, say, quiet
        self.store = LabelStore(settings.path)
        self.mine: list[int] = []
        self.k = 0
        self.bar: Progress | None = None
        self.counted = 0  # blocks of this run the bar has counted

    def setup(self, stage: str) -> None:
        total = int(self.blocks.shape[0])
        if self.global_rank == 0:
            meta = self.store.begin(self.identity, self.settings.shard_blocks, self.say)
            if meta["done"] == total:
                self.say(f"{self.store.path}: all {total} blocks were done")
            elif meta["done"]:
                self.say(f"{self.store.path}: {meta['done']} of {total} blocks were done; "
                         "continuing")
        self.trainer.strategy.barrier("oracle-begin")
        pending = self.store.pending(total)
        world, rank = self.trainer.world_size, self.global_rank
        steps = max(1, -(-len(pending) // world))  # every rank runs as many steps
        mine = pending[rank::world]
        self.mine = mine + [-1] * (steps - len(mine))
        self.k = int(self.store.manifest()["shard_blocks"])  # the folder's, read once
        left = sum(min(total, (i + 1) * self.k) - i * self.k for i in pending)
        if pending:  # only rank 0 draws
            self.bar = Progress(total, "oracle labels", "block", done=total - left,
                                quiet=self.quiet or rank != 0)

    def predict_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.mine, batch_size=None, shuffle=False)

    def predict_step(self, index: Any, batch_idx: int) -> None:
        index = int(index)
        if index >= 0:
            rows = self.blocks[index * self.k:(index + 1) * self.k]
            labels = shard_labels(self.base, self.tokenizer, rows, self.settings,
                                  int(self.identity["layout"]["context"]))
            record = self.store.write_shard(index, labels, self.global_rank)
            if self.trainer.world_size == 1:
                self.count(record["stop"] - record["start"],
                           f"blocks {record['start']}-{record['stop'] - 1}")
                return
        if self.global_rank == 0:  # every rank's shards, from their progress files
            self.count(self.store.recorded_blocks() - self.counted,
                       f"{self.trainer.world_size} processes")

    def count(self, blocks: int, note: str) -> None:
        if self.bar is not None and blocks > 0:
            self.counted += blocks
            self.bar.advance(blocks, note)

    def on_predict_end(self) -> None:
        self.trainer.strategy.barrier("oracle-end")
        if self.global_rank == 0:
            if self.trainer.world_size > 1:
                self.count(self.store.recorded_blocks() - self.counted,
                           f"{self.trainer.world_size} processes")
            self.close()
            self.store.merge(self.say)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def labelling_trainer(accelerator: str = "cpu", devices: int | list[int] = 1, num_nodes: int = 1,
                      strategy: str = "auto") -> L.Trainer:
    """The Trainer of a labelling run: no logger, checkpoints or bar of Lightning's (the
    labeller draws its own, counting blocks); ``devices`` > 1 or ``num_nodes`` > 1 runs DDP
    (gloo on the CPU)."""
    count = len(devices) if isinstance(devices, (list, tuple)) else int(devices)
    if strategy == "auto" and (num_nodes > 1 or count > 1):
        strategy = "ddp"
    return L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes,
                     strategy=strategy, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, inference_mode=False)


def compute_labels(model: Any, tokenizer: Any, blocks: Tensor, settings: OracleLabels,
                   identity: dict[str, Any], say: Callable[[str], None] = print,
                   trainer: L.Trainer | None = None, quiet: bool = False) -> LabelStore:
    """Labels of every block ``blocks[:, :context]`` (``identity['layout']['context']``) into
    ``settings.path``, continuing where a run before stopped (one CPU process unless
    ``trainer`` says otherwise: ``labelling_trainer``). ``say``: the run's lines; progress is
    shown on stderr unless ``quiet`` (``kvgate.progress``)."""
    labeller = Labeller(model, tokenizer, blocks, settings, identity, say, quiet)
    trainer = trainer or labelling_trainer()
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # its device and tip lines say nothing about labels
    try:
        trainer.predict(labeller, return_predictions=False)
    except SystemExit:
        # Lightning answers Ctrl-C with exit status 1 and SIGINT ignored from then on: give the
        # interrupt back, so the command line's one interrupt path reports it (exit 130)
        if trainer.interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if trainer.world_size == 1:  # the finished shards counted now (DDP: by the rerun)
                labeller.store.merge(lambda _line: None)
            raise KeyboardInterrupt from None
        raise
    finally:
        labeller.close()
        lightning_log.setLevel(level)
    return labeller.store


def label_data(model: Any, tokenizer: Any, data: Any, base: str,
               say: Callable[[str], None] = print,
               trainer: L.Trainer | None = None, quiet: bool = False) -> LabelStore:
    """The oracle labels of a CPT data module's training blocks (``data.oracle`` says where and
    with which KVzip; ``data.train_blocks``, ``label_context`` and ``describe`` what they are)
    on ``model``, the base named ``base``. ``say``: the run's lines (stdout); progress goes to
    stderr unless ``quiet``."""
    from kvgate.data.oracle.identity import base_fingerprint, block_layout

    data.tokenizer = tokenizer
    blocks = data.train_blocks()
    layout = block_layout(blocks, data.label_context())
    text = getattr(model.config, "text_config", model.config)
    identity = {
        "base": {"id": base, "fingerprint": base_fingerprint(model)},
        "kvzip": data.oracle.kvzip(), "layout": layout, "corpus": data.describe(),
        "shape": {"layers": int(text.num_hidden_layers),
                  "kv_heads": int(getattr(text, "num_key_value_heads", None)
                                  or text.num_attention_heads)},
    }
    say(f"oracle labels: {layout['blocks']} blocks x {layout['context']} tokens of {base} "
        f"({'KVzip+' if data.oracle.plus else 'KVzip'}) -> {data.oracle.path}")
    store = compute_labels(model, tokenizer, blocks, data.oracle, identity, say, trainer, quiet)
    say(f"done: {store.manifest_path}")
    return store
