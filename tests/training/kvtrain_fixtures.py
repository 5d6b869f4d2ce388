"""Tiny on-disk base models (random LLaMA/Mistral + a character tokenizer) and synthetic data
for the training tests: everything loads through ``kvgate.models.load_base`` like a real model."""

from __future__ import annotations

import random
from pathlib import Path

import yaml
from conftest import build, tiny_llama_config, tiny_mistral_config
from lightning.pytorch import Callback
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvgate.data.tasks import MCExample
from kvgate.training.data import CPTDataModule, SFTDataModule

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]  # 4 + 96 ids < the tiny vocab of 128


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def save_tiny_base(folder: Path, arch: str = "llama", **overrides) -> str:
    """Write a tiny random model + tokenizer as a Hugging Face folder; returns its path."""
    cfg = (tiny_llama_config if arch == "llama" else tiny_mistral_config)(**overrides)
    build(cfg).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "and",
    "birds", "sang", "in", "tall", "green", "trees", "near", "the", "old", "river", "bank",
]


def synthetic_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(n)]


class SyntheticCPT(CPTDataModule):
    """CPT data module over generated text (no corpus needed)."""

    def __init__(self, n_docs: int = 40, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_docs = n_docs

    def load_documents(self) -> list[str]:
        return synthetic_docs(self.n_docs, self.seed)


def synthetic_examples(n: int, seed: int = 0) -> list[MCExample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(WORDS, 2)
        gold = rng.randint(0, 1)
        out.append(MCExample(task="rte", uid=f"syn:{seed}:{i}",
                             context=f"{a} or {b}? pick {(a, b)[gold]}\nAnswer:",
                             choices=[f" {a}", f" {b}"], gold=gold))
    return out


class SyntheticSFT(SFTDataModule):
    """SFT data module over generated two-choice examples."""

    def __init__(self, n_train: int = 16, n_val: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_train, self.n_val = n_train, n_val

    def examples(self, part, limit):
        n = self.n_train if part == "train" else self.n_val
        return synthetic_examples(n, seed=0 if part == "train" else 1)


class FolderWriter(Callback):
    """A callback that writes to a folder of its own, which --run_dir does not know."""

    def __init__(self, dirpath: str = "somewhere") -> None:
        self.dirpath = dirpath


def tiny_config(tmp_path: Path, base_dir: str, **trainer) -> Path:
    """A complete run config on the tiny model and synthetic text."""
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 3, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "limit_val_batches": 0, "default_root_dir": str(tmp_path / "run"),
                    "callbacks": [
                        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                         "init_args": {"dirpath": str(tmp_path / "run" / "ckpt"),
                                       "save_last": True, "every_n_train_steps": 1}},
                        {"class_path": "kvgate.training.callbacks.ExportGated",
                         "init_args": {"dirpath": str(tmp_path / "run" / "gated")}}],
                    **trainer},
        "model": {"base_model": base_dir, "train": "gates_lora", "image_every_n_steps": 0,
                  "gate": {"beta": 0.3}, "lora": {"rank": 4, "dropout": 0.0}},
        "data": {"class_path": "kvtrain_fixtures.SyntheticCPT",
                 "init_args": {"seq_len": 16, "batch_size": 2, "val_fraction": 0.0}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class SignalAt(Callback):
    """Sends ``signum`` to this process when training step ``step`` starts (a kill from
    outside, at a known step)."""

    def __init__(self, step: int = 1, signum: int = 15) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import os

        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def with_callback(config: Path, callback: dict, out: Path) -> Path:
    """A copy of the run config ``config`` at ``out`` with one more trainer callback."""
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"]["callbacks"].append(callback)
    out.write_text(yaml.safe_dump(cfg))
    return out


def poison_gates(folder: Path, value: float = float("nan")) -> str:
    """Write ``value`` into one entry of a gated export's first gate tensor and list the new
    file in its inventory (as a diverged run's export would be): only the values are wrong.
    Returns the tensor's key."""
    import json

    from safetensors.torch import load_file, save_file

    from kvgate.checkpoint import CONFIG_NAME, FORMAT, GATES_NAME, sha256_file

    path = folder / GATES_NAME
    tensors = load_file(str(path))
    key = min(tensors)
    tensors[key].view(-1)[0] = value
    save_file(tensors, str(path), metadata={"format": FORMAT})
    meta = json.loads((folder / CONFIG_NAME).read_text())
    meta["files"][GATES_NAME] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    return key
