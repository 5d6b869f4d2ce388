"""Oracle labels (``kvgate data oracle``): the kvzip policy's own scores, refused on another
base, KVzip or block layout, and a killed run that resumes to what an unbroken one writes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, tiny_llama_config
from kvtrain_fixtures import SyntheticCPT, char_tokenizer

from kvgate.data.oracle import (
    LabelStore,
    OracleError,
    OracleLabels,
    base_fingerprint,
    block_layout,
    load_labels,
)
from kvgate.data.oracle import compute as compute_mod
from kvgate.data.oracle import store as store_mod
from kvgate.data.oracle.compute import label_data
from kvgate.inference import Engine
from kvgate.policies import KVzip

SEQ, CHUNK = 24, 16  # two repeat chunks per block


class Spy(KVzip):
    """KVzip that records the scores its all-layer choice ranks."""

    def choose(self, scores, valid, budget):
        self.seen = scores.clone()
        return super().choose(scores, valid, budget)


def data(path, **oracle) -> SyntheticCPT:
    dm = SyntheticCPT(n_docs=3, seq_len=SEQ, batch_size=2, val_fraction=0.0,
                      oracle={"path": str(path), "chunk": CHUNK, "shard_blocks": 3, **oracle})
    dm.tokenizer = char_tokenizer()
    return dm


def quiet(_line: str) -> None:
    pass


def other_base() -> torch.nn.Module:
    """The same architecture with other weights (a fine-tune, as far as labels can tell)."""
    model = build(tiny_llama_config())
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    return model


@pytest.mark.parametrize("plus", [False, True])
def test_labels_are_the_kvzip_policys_own_scores(tmp_path, plus):
    model, tok = build(tiny_llama_config()), char_tokenizer()
    dm = data(tmp_path / "labels", plus=plus)
    label_data(model, tok, dm, "tiny", quiet)
    blocks = dm.train_blocks()
    labels = LabelStore(dm.oracle.path).read()
    assert labels.dtype == torch.float16 and labels.shape == (blocks.shape[0], 2, 2, SEQ)
    for i in (0, blocks.shape[0] - 1):
        spy = Spy(plus=plus, chunk=CHUNK, sinks=4)
        ids = blocks[i:i + 1]
        Engine(build(tiny_llama_config()), tok, spy, 0.5).prefill(ids, torch.ones_like(ids))
        want = spy.seen[:, 0].clamp(min=1e-30).log()  # [L, H_kv, n]
        torch.testing.assert_close(labels[i].float(), want, rtol=2e-3, atol=2e-3)
    meta = json.loads((tmp_path / "labels" / "manifest.json").read_text())
    assert meta["done"] == blocks.shape[0] and meta["kvzip"]["plus"] is plus
    assert meta["base"]["fingerprint"] == base_fingerprint(model)


def test_labels_are_refused_for_another_base(tmp_path):
    model, tok = build(tiny_llama_config()), char_tokenizer()
    dm = data(tmp_path / "labels")
    label_data(model, tok, dm, "tiny", quiet)
    layout = block_layout(dm.train_blocks(), dm.label_context())
    assert load_labels(dm.oracle, base_fingerprint(model), layout).shape[0] == layout["blocks"]
    other = base_fingerprint(other_base())
    from kvgate.models import model_fingerprint  # the architecture alone cannot tell them apart

    assert model_fingerprint(other_base().config) == model_fingerprint(model.config)
    assert other != base_fingerprint(model)
    with pytest.raises(OracleError, match="another base") as err:
        load_labels(dm.oracle, other, layout)
    assert "\n" not in str(err.value)
    with pytest.raises(OracleError, match="another base"):  # nor continued on it
        label_data(other_base(), tok, dm, "other", quiet)


def test_labels_are_refused_for_other_kvzip_or_blocks(tmp_path):
    model, tok = build(tiny_llama_config()), char_tokenizer()
    dm = data(tmp_path / "labels")
    label_data(model, tok, dm, "tiny", quiet)
    fp = base_fingerprint(model)
    layout = block_layout(dm.train_blocks(), dm.label_context())
    with pytest.raises(OracleError, match="another KVzip"):
        load_labels(OracleLabels(path=dm.oracle.path, chunk=CHUNK, shard_blocks=3, plus=False),
                    fp, layout)
    longer = data(tmp_path / "labels")
    longer.seq_len = SEQ + 8
    with pytest.raises(OracleError, match="another block layout.*seq_len"):
        load_labels(dm.oracle, fp, block_layout(longer.train_blocks(), longer.label_context()))
    with pytest.raises(OracleError, match="another block layout"):
        label_data(model, tok, longer, "tiny", quiet)
    with pytest.raises(OracleError, match="no oracle labels"):
        load_labels(OracleLabels(path=str(tmp_path / "none")), fp, layout)


def test_unfinished_labels_are_refused(tmp_path, monkeypatch):
    model, tok = build(tiny_llama_config()), char_tokenizer()
    dm = data(tmp_path / "labels")
    killed_after(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        label_data(model, tok, dm, "tiny", quiet)
    layout = block_layout(dm.train_blocks(), dm.label_context())
    with pytest.raises(OracleError, match=f"cover 3 of {layout['blocks']} blocks"):
        load_labels(dm.oracle, base_fingerprint(model), layout)


def killed_after(monkeypatch, calls: int) -> None:
    """The ``calls``-th block's forward is interrupted (a kill mid-shard)."""
    real, seen = compute_mod.block_scores, []

    def dying(*args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(compute_mod, "block_scores", dying)


@pytest.mark.parametrize("kill", ["mid_shard", "before_manifest"])
def test_a_resumed_run_writes_what_an_unbroken_one_does(tmp_path, monkeypatch, kill):
    tok = char_tokenizer()
    whole = data(tmp_path / "whole")
    label_data(build(tiny_llama_config()), tok, whole, "tiny", quiet)
    broken = data(tmp_path / "broken")
    with monkeypatch.context() as patch:
        if kill == "mid_shard":
            killed_after(patch, 5)  # shard 1 is done, shard 2 half
        else:  # the second shard renamed into place, the manifest not yet told
            real, writes = store_mod.write_json_atomic, []

            def dying(path, value):
                writes.append(1)
                if len(writes) == 3:  # the new manifest, shard 1's update, shard 2's
                    raise KeyboardInterrupt
                real(path, value)

            patch.setattr(store_mod, "write_json_atomic", dying)
        with pytest.raises(KeyboardInterrupt):
            label_data(build(tiny_llama_config()), tok, broken, "tiny", quiet)
    store = LabelStore(broken.oracle.path)
    assert store.manifest()["done"] == 3
    assert not list(store.path.glob(".*.tmp"))  # nothing half-written was left
    (store.path / ".shard-00001.safetensors.x.tmp").write_bytes(b"half")  # as a SIGKILL leaves
    lines = []
    label_data(build(tiny_llama_config()), tok, data(tmp_path / "broken"), "tiny", lines.append)
    assert any("3 of" in line and "continuing" in line for line in lines)
    assert not list(store.path.glob(".*.tmp"))
    assert torch.equal(store.read(), LabelStore(whole.oracle.path).read())
    a, b = store.manifest(), LabelStore(whole.oracle.path).manifest()
    assert a["shards"] == b["shards"] and a["done"] == b["done"]


@pytest.mark.parametrize("bad, match", [
    ({"chunk": 0}, "OracleLabels.chunk: must be an integer >= 1"),
    ({"sinks": -1}, "OracleLabels.sinks"),
    ({"plus": "yes"}, "OracleLabels.plus: must be true or false"),
    ({"shard_blocks": 0}, "OracleLabels.shard_blocks"),
    ({"path": ""}, "OracleLabels.path"),
    ({"nope": 1}, r"unknown key\(s\) \['nope'\]"),
])
def test_bad_label_settings_are_one_line_errors(tmp_path, bad, match):
    with pytest.raises(OracleError, match=match) as err:
        SyntheticCPT(seq_len=SEQ, oracle={"path": str(tmp_path), **bad})
    assert "\n" not in str(err.value)
