"""The top-level API a user meets first: ``import kvgate`` and the names the README shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvgate

NAMES = ["load_base", "load_gated", "Engine", "get_policy", "list_policies", "GateConfig",
         "patch", "unpatch", "KVGateError", "Budget", "CompressedCache"]


@pytest.mark.parametrize("name", NAMES)
def test_each_public_name_resolves(name):
    assert name in kvgate.__all__ and name in dir(kvgate)
    assert getattr(kvgate, name) is not None


def test_import_kvgate_stays_light():
    # the facade imports nothing heavy until a name is used (the CLI's --help relies on it)
    code = "import sys, kvgate; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvgate.nope  # noqa: B018


def test_knorm_is_listed_and_errors_share_one_root():
    assert "knorm" in kvgate.list_policies()
    with pytest.raises(kvgate.KVGateError):
        kvgate.get_policy("no-such-policy")
    with pytest.raises(kvgate.KVGateError):
        kvgate.GateConfig(tau=2.0).validate()


def test_readme_engine_lines_run_on_a_tiny_model(tiny_llama):
    from inference.engine_toys import char_tokenizer

    engine = kvgate.Engine(tiny_llama, char_tokenizer(), kvgate.get_policy("snapkv", window=4),
                           budget=0.5)
    result = engine.generate(["hello there"], max_new_tokens=3)
    assert len(result.texts) == 1 and "kept" in result.stats.table().lower()


def test_all_lists_exactly_the_lazy_names():
    assert sorted(set(kvgate.__all__) - {"__version__"}) == sorted(kvgate._EXPORTS)
