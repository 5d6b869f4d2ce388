"""Gated checkpoint format: export -> load_gated round trips, and every way it refuses input."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from training.kvtrain_fixtures import SyntheticCPT, save_tiny_base

from kvgate.checkpoint import (
    CONFIG_NAME,
    GATES_NAME,
    CheckpointError,
    export_gated,
    load_gated,
    read_meta,
)
from kvgate.gate import gate_modules
from kvgate.training.export import export_checkpoint, export_module
from kvgate.training.module import KVGateModule


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {"llama": save_tiny_base(root / "llama"),
            "other": save_tiny_base(root / "other", hidden_size=32, intermediate_size=64)}


def trained_module(base: str, train: str = "gates_lora") -> KVGateModule:
    """A built module whose LoRA and gates hold non-trivial values (as after training)."""
    torch.manual_seed(1)
    module = KVGateModule(base_model=base, train=train, image_every_n_steps=0)
    module.configure_model()
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return module.eval()


def logits_of(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.fixture(scope="module")
def exported(bases, tmp_path_factory):
    module = trained_module(bases["llama"])
    out = export_module(module, tmp_path_factory.mktemp("exp") / "gated")
    return module, out


def test_round_trip_gives_identical_logits(exported):
    module, out = exported
    model, tokenizer, meta = load_gated(out, merge_lora=False)
    assert len(gate_modules(model)) == len(gate_modules(module.model)) > 0
    assert torch.equal(logits_of(model), logits_of(module.model))
    # the default folds LoRA in: a plain transformers model, equal up to rounding
    merged, _, _ = load_gated(out)
    assert not hasattr(merged, "peft_config") and len(gate_modules(merged)) > 0
    torch.testing.assert_close(logits_of(merged), logits_of(module.model), atol=1e-4, rtol=1e-4)
    assert tokenizer is not None and meta["base"]["fingerprint"] == module.fingerprint
    assert meta["gate"] == module.gate_cfg.to_dict() and meta["lora"] is True
    assert all(not p.requires_grad for p in model.parameters())


def test_only_safetensors_and_json_are_written(exported):
    _, out = exported
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".json", ".safetensors", ".jinja"}
    assert (out / GATES_NAME).is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no temp leftovers


def test_merged_export_matches_the_unmerged_model(bases, tmp_path):
    module = trained_module(bases["llama"])
    out = export_module(module, tmp_path / "merged", merge=True)
    meta = read_meta(out)
    assert meta["merged"] and not meta["lora"] and (out / "merged" / "config.json").is_file()
    model, _, _ = load_gated(out)
    assert not hasattr(model, "peft_config")
    torch.testing.assert_close(logits_of(model), logits_of(module.model), atol=1e-4, rtol=1e-4)
    # exporting merged did not change the trained model itself
    assert any(".lora_" in n for n, _ in module.model.named_parameters())


@pytest.mark.parametrize("train", ["gates", "lora"])
def test_single_part_exports_round_trip(bases, tmp_path, train):
    module = trained_module(bases["llama"], train=train)
    model, _, meta = load_gated(export_module(module, tmp_path / train), merge_lora=False)
    assert (meta["gate"] is not None) == (train == "gates")
    assert meta["lora"] == (train == "lora")
    assert torch.equal(logits_of(model), logits_of(module.model))


def test_a_base_of_another_shape_is_refused(exported, bases):
    _, out = exported
    with pytest.raises(CheckpointError, match="base model mismatch"):
        load_gated(out, base=bases["other"])


def copy_of(out, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def test_truncated_and_corrupt_files_are_refused(exported, tmp_path):
    _, out = exported
    ckpt = copy_of(out, tmp_path)
    gates = ckpt / GATES_NAME
    data = gates.read_bytes()
    gates.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_gated(ckpt)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_gated(ckpt, verify=False)  # even unchecked, safetensors' error is made clear
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    gates.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="sha256"):
        load_gated(ckpt)


def test_missing_files_are_refused(exported, tmp_path):
    _, out = exported
    ckpt = copy_of(out, tmp_path)
    (ckpt / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_gated(ckpt)
    (ckpt / CONFIG_NAME).unlink()
    with pytest.raises(CheckpointError, match=CONFIG_NAME):
        load_gated(ckpt)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_gated(tmp_path / "nowhere")


def test_unknown_version_and_garbled_config_are_refused(exported, tmp_path):
    _, out = exported
    ckpt = copy_of(out, tmp_path)
    meta = json.loads((ckpt / CONFIG_NAME).read_text())
    meta["format_version"] = 99
    (ckpt / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format_version 99"):
        load_gated(ckpt)
    (ckpt / CONFIG_NAME).write_text('{"format": "kvgate-ga')
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_gated(ckpt)


def test_failed_export_leaves_nothing_behind(bases, tmp_path, monkeypatch):
    import kvgate.checkpoint as ck

    module = trained_module(bases["llama"], train="gates")
    export_module(module, tmp_path / "kept")
    before = sorted(p.name for p in tmp_path.iterdir())

    def boom(root):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_inventory", boom)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'new'}: cannot write .*disk full"):
        export_module(module, tmp_path / "new")
    with pytest.raises(CheckpointError, match="disk full"):
        export_module(module, tmp_path / "kept", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert read_meta(tmp_path / "kept")  # the old export survived the failed overwrite
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="already exists"):
        export_module(module, tmp_path / "kept")


def test_export_from_a_lightning_checkpoint(bases, tmp_path):
    module = KVGateModule(base_model=bases["llama"], train="gates_lora", image_every_n_steps=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt], limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, SyntheticCPT(seq_len=16, batch_size=2, val_fraction=0.0))
    out = export_checkpoint(tmp_path / "ckpt" / "last.ckpt", tmp_path / "out")
    assert out == tmp_path / "out"
    model, _, meta = load_gated(out, merge_lora=False)
    assert meta["training"]["global_step"] == 2 and meta["training"]["train"] == "gates_lora"
    assert torch.equal(logits_of(model), logits_of(module.model.eval()))
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_an_out_that_cannot_be_written_is_one_checkpoint_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "gated"
    with pytest.raises(CheckpointError, match=f"{out}: cannot write"):
        export_gated(torch.nn.Linear(2, 2), out, base_model="b", fingerprint="f")


HANG = """
import sys, time, torch
import kvgate.checkpoint as ck
def hang(root):
    print("writing", flush=True)
    time.sleep(120)
ck._inventory = hang
ck.export_gated(torch.nn.Linear(2, 2), sys.argv[1], base_model="b", fingerprint="f")
"""


def _export_in_child(out):
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", HANG, str(out)], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert child.stdout.readline().strip() == "writing"  # its temporary folder exists now
    return child


def test_the_next_export_removes_the_temporaries_of_a_killed_one(tmp_path):
    """Issue #36 case 5: a killed export leaves .NAME.tmp-* behind; the next export into the
    same folder removes those of dead processes and keeps those of a live export."""
    import os
    import socket
    import subprocess
    import time

    out = tmp_path / "gated"
    killed = _export_in_child(out)
    killed.kill()
    killed.wait()
    temps = [p.name for p in tmp_path.iterdir()]
    assert len(temps) == 1 and temps[0].startswith(f".gated.tmp-{killed.pid}@"), temps
    # a live export elsewhere (any running process stands for it) keeps its temporary
    live = subprocess.Popen(["sleep", "60"])
    kept = tmp_path / f".gated.tmp-{live.pid}@{socket.gethostname()}-abcd1234"
    # temporaries of an older kvgate carry no pid: judged by age
    old, recent = tmp_path / ".gated.tmp-abcd1234", tmp_path / ".gated.tmp-efgh5678"
    for folder in (kept, old, recent):
        folder.mkdir()
        (folder / "gates.safetensors").write_bytes(b"x" * 10)
    day_ago = time.time() - 86400
    for path in (old / "gates.safetensors", old):
        os.utime(path, (day_ago, day_ago))
    (tmp_path / ".other.tmp-zzzz").mkdir()  # another export's: not ours to judge
    try:
        export_gated(torch.nn.Linear(2, 2), out, base_model="b", fingerprint="f")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {"gated", kept.name, recent.name, ".other.tmp-zzzz"}, left
        assert read_meta(out)
    finally:
        live.kill()
        live.wait()


def test_load_gated_checks_the_device_before_reading_anything(tmp_path):
    from kvgate.checkpoint import load_gated
    from kvgate.models.errors import ModelLoadError

    # the folder does not even exist: the device is refused first, in one line
    with pytest.raises(ModelLoadError, match="not a device torch knows") as err:
        load_gated(tmp_path / "nope", device="gpu0x")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- issue #46: what --overwrite may replace
def tiny_export(out, **kwargs):
    return export_gated(torch.nn.Linear(2, 2), out, base_model="b", fingerprint="f", **kwargs)


def test_overwrite_replaces_only_a_gated_export_or_an_empty_folder(tmp_path):
    """Issue #46 (data loss): ``--overwrite`` replaced any folder, a run folder included."""
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "others").mkdir()
    (tmp_path / "others" / "notes.txt").write_text("keep me")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    (run / "tb").mkdir()
    refused = {"afile": "is a file, not a gated export",
               "others": "holds files that are not a gated export",
               "run": "is a training run's folder .*checkpoints, tb"}
    for name, why in refused.items():
        with pytest.raises(CheckpointError, match=f"{tmp_path / name}: {why}"):
            tiny_export(tmp_path / name, overwrite=True)
    with pytest.raises(CheckpointError, match="holds the checkpoint being exported"):
        tiny_export(tmp_path / "run", overwrite=True, inputs=[run / "checkpoints" / "last.ckpt"])
    assert (tmp_path / "afile").read_text() == "keep me"
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "others", "run"]
    (tmp_path / "empty").mkdir()
    for name in ("empty", "empty"):  # an empty folder, then the gated export now there
        assert read_meta(tiny_export(tmp_path / name, overwrite=True))
    inside = tmp_path / "empty" / "in.ckpt"  # even a gated export is kept when it holds the input
    inside.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="holds the checkpoint being exported"):
        tiny_export(tmp_path / "empty", overwrite=True, inputs=[inside])


def test_leftovers_of_an_interrupted_replace_are_removed_whatever_their_kind(tmp_path):
    """Issue #46 case 6: the old OUT moved aside as ``.NAME.old-PID@HOST-*`` stayed for good
    when it was a file (the clean-up removed folders only)."""
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = f"{dead.pid}@{socket.gethostname()}-abcd1234"
    (tmp_path / f".gated.old-{tag}").write_text("an old file")
    (tmp_path / f".gated.tmp-{tag}").symlink_to(tmp_path / "nowhere")
    (tmp_path / "target").mkdir()
    (tmp_path / f".gated.old-{tag}x").symlink_to(tmp_path / "target")
    tiny_export(tmp_path / "gated")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gated", "target"]


def test_a_base_that_differs_names_the_field(exported, bases):
    """Issue #46 case 13: the error named two fingerprints, not the field that differs."""
    _, out = exported
    meta = read_meta(out)
    assert meta["base"]["architecture"]["hidden_size"] == 64
    with pytest.raises(CheckpointError, match=r"whose hidden_size is 64; the given base has "
                                              r"hidden_size 32 \(and 1 more field"):
        load_gated(out, base=bases["other"])


def test_export_of_an_exported_folder_or_a_plain_folder_is_one_line(exported, tmp_path, capsys):
    """Issue #46 case 12: an exported folder was taken for a DeepSpeed checkpoint."""
    from kvgate.cli.export import main as export_main

    _, out = exported
    (tmp_path / "plain").mkdir()
    for src, why in ((out, "a gated export"), (tmp_path / "plain", "a folder, but neither")):
        assert export_main([str(src), str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {src}: {why}"), err
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------- issue #64
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_gates_are_neither_exported_nor_loaded(bases, tmp_path, value):
    """#64: a diverged run's all-NaN gates were exported and loaded as if trained."""
    from training.kvtrain_fixtures import poison_gates

    module = trained_module(bases["llama"])
    gate = gate_modules(module.model)[1]
    name, param = next(iter(gate.named_parameters()))
    with torch.no_grad():
        param.view(-1)[3] = value
    word = "NaN" if math.isnan(value) else "infinite"
    with pytest.raises(CheckpointError, match=rf"not exported: tensor '1\.{name}' holds {word}"):
        export_module(module, tmp_path / "gated")
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary
    with torch.no_grad():
        param.view(-1)[3] = 0.0
    out = export_module(module, tmp_path / "gated")
    key = poison_gates(out, value)
    with pytest.raises(CheckpointError, match=rf"{GATES_NAME}: tensor '{key}' holds {word}"):
        load_gated(out)


def test_a_non_finite_lightning_checkpoint_is_not_exported_before_the_base_loads(
        bases, tmp_path, monkeypatch):
    module = trained_module(bases["llama"])
    state = {n: p.detach().clone() for n, p in module.trainable_named_parameters()}
    first = min(state)
    state[first].view(-1)[0] = float("nan")
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": state,
                "hyper_parameters": dict(module.hparams)}, ckpt)
    monkeypatch.setattr(KVGateModule, "configure_model",
                        lambda self: pytest.fail("the base loaded for a checkpoint it refuses"))
    with pytest.raises(CheckpointError, match=rf"not exported: tensor '{first}' holds NaN"):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask, folder, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600),
                                                 (0o002, 0o775, 0o664)])
def test_an_export_honours_the_umask(bases, tmp_path, umask, folder, file):
    """#64 case 16: exports were 0700 folders and 0600 gate files whatever the umask
    (tempfile.mkdtemp, and safetensors' own writes)."""
    import os
    import stat

    module = trained_module(bases["llama"])
    old = os.umask(umask)
    try:
        out = export_module(module, tmp_path / "gated")
        export_module(module, out, overwrite=True)  # a replaced export too
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [out, *out.rglob("*")]}
    assert (out / GATES_NAME).is_file() and (out / "adapter").is_dir()
    wrong = {k: oct(m) for k, m in modes.items()
             if m != (folder if (tmp_path / k).is_dir() else file)}
    assert not wrong, wrong
