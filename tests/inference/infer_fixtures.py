"""The fixtures of infer.py's tests (test_infer_cli, test_kv_bits): the script, and a tiny
random model in place of the base loader. A module both import rather than a conftest.py: the
tests import ``build`` and friends from tests/conftest.py by name, which a second conftest.py
would shadow (pytest loads every conftest.py outside a package as the module ``conftest``).
Each fixture is registered under its ``name`` and imported as ``*_fixture``, so a test's
argument of that name does not redefine an import."""

from __future__ import annotations

import pytest
from conftest import build, load_script, tiny_llama_config
from engine_toys import char_tokenizer

import kvgate.models


@pytest.fixture(scope="module", name="cli")
def cli_fixture():
    return load_script("infer.py")


def fake_base(monkeypatch, make_tokenizer) -> list:
    """load_base -> a tiny random model and ``make_tokenizer()``; returns the names loaded."""
    calls = []

    def fake_load_base(name, dtype="float32", device="cpu"):
        calls.append(name)
        return build(tiny_llama_config()), make_tokenizer()

    monkeypatch.setattr(kvgate.models, "load_base", fake_load_base)
    return calls


@pytest.fixture(name="tiny_base")
def tiny_base_fixture(monkeypatch):
    """load_base -> a tiny random model; records the calls."""
    return fake_base(monkeypatch, char_tokenizer)
