"""Oracle labels of training blocks: the ``kvzip`` policy's own scores, read before its choice.

Each block is a context of its own: prefilled into a ``CompressedCache`` under the ``kvzip``
policy, whose repeat passes then run as at inference (``kvgate.inference.compress.run_passes``,
KVzip arXiv:2505.23416; KVzip+ arXiv:2601.07891); the running scores are read before any entry
is evicted (``kvgate.cache.passes.running_scores``). No second KVzip lives here: what a label
says is exactly what the policy would rank.

One block per forward, in order: a block's labels never depend on which blocks share its
batch, so a resumed run writes what an unbroken one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvgate.data.oracle.settings import OracleLabels
from kvgate.data.oracle.store import LOG_FLOOR, LabelStore


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


def compute_labels(model: Any, tokenizer: Any, blocks: Tensor, settings: OracleLabels,
                   identity: dict[str, Any],
                   progress: Callable[[str], None] = print) -> LabelStore:
    """Labels of every block ``blocks[:, :context]`` (``identity['layout']['context']``) into
    ``settings.path``, continuing where a run before stopped."""
    store = LabelStore(settings.path)
    done = store.begin(identity)
    total = int(blocks.shape[0])
    context = int(identity["layout"]["context"])
    device = next(model.parameters()).device
    if done == total:
        progress(f"{store.path}: all {total} blocks were done")
    elif done:
        progress(f"{store.path}: {done} of {total} blocks were done; continuing")
    t0 = time.perf_counter()
    for start in range(done, total, settings.shard_blocks):  # a loop over shards
        stop = min(total, start + settings.shard_blocks)
        rows = [log_scores(block_scores(model, tokenizer, blocks[i:i + 1, :context].to(device),
                                        settings))[0].cpu()
                for i in range(start, stop)]  # a loop over blocks: one forward each
        store.write_shard(start, torch.stack(rows))
        rate = (time.perf_counter() - t0) / (stop - done)
        progress(f"blocks {stop}/{total} ({rate:.1f} s/block, ~{rate * (total - stop) / 60:.0f} "
                 "min left)")
    return store


def label_data(model: Any, tokenizer: Any, data: Any, base: str,
               progress: Callable[[str], None] = print) -> LabelStore:
    """The oracle labels of a CPT data module's training blocks (``data.oracle`` says where and
    with which KVzip; ``data.train_blocks``, ``label_context`` and ``describe`` what they are)
    on ``model``, the base named ``base``."""
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
    progress(f"oracle labels: {layout['blocks']} blocks x {layout['context']} tokens of {base} "
             f"({'KVzip+' if data.oracle.plus else 'KVzip'}) -> {data.oracle.path}")
    store = compute_labels(model, tokenizer, blocks, data.oracle, identity, progress)
    progress(f"done: {store.manifest_path}")
    return store
